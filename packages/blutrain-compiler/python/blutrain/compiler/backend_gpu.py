"""GPU code: fused linalg -> parallel loops mapped by the compiler's block shapes -> PTX (NVPTX).

Pipeline (upstream passes; block shapes are ours):
  per function: convert-linalg-to-parallel-loops, scf-parallel-loop-tiling with the tile
  sizes chosen below, gpu-map-parallel-loops; then convert-parallel-loops-to-gpu,
  gpu-kernel-outlining, and for the device modules nvvm-attach-target{chip=sm_90},
  convert-gpu-to-nvvm (bare-pointer memrefs: one pointer per buffer), gpu-module-to-binary
  {format=isa}. The host side is read, not compiled: after outlining, each function is a list of
  `gpu.launch_func` (kernel, grid, block, operands) and `memref.alloc` (temporaries), which the
  runtime replays with cuLaunchKernel on blutrain.tensor's current stream.

Block shapes: the innermost (contiguous) loop dimension goes to threadIdx.x in tiles of up to
256 threads, so consecutive threads touch consecutive elements (coalesced); outer dimensions go
to blocks. Row reductions (a norm's statistics, a softmax's max and sum) map rows to threads in
blocks of 128 rows after their elementwise producers are fused into them.
"""

from __future__ import annotations

import glob
import math
import os
from dataclasses import dataclass, field
from typing import Any

CHIP = "sm_90"
FEATURES = "+ptx80"
THREADS = 256  # threads per block for elementwise loops


def libdevice() -> str | None:
    """libdevice.10.bc for math functions without an NVPTX instruction (log, erf, sin...)."""
    env = os.environ.get("BLUTRAIN_LIBDEVICE")
    if env and os.path.exists(env):
        return env
    roots = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    roots += sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for r in roots:
        p = os.path.join(r, "nvvm", "libdevice", "libdevice.10.bc")
        if r and os.path.exists(p):
            return p
    return None


@dataclass
class Launch:
    kernel: str  # function name inside the module
    module: str  # gpu.module symbol
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    # ("arg", i) | ("tmp", j) | ("int" | "b16" | "f32" | "f64", value)
    operands: list[tuple[str, int]]


@dataclass
class GpuFunction:
    name: str
    launches: list[Launch] = field(default_factory=list)
    temps: list[tuple[tuple[int, ...], str, int]] = field(
        default_factory=list
    )  # shape, type, bytes
    # (output argument, input argument) pairs the output may be written over (Note [outputs
    # over dead inputs])
    inplace: list[tuple[int, int]] = field(default_factory=list)


def tile_sizes(shape: list[int]) -> list[int]:
    """Tiles of a parallel loop nest: innermost dim to threads (coalesced), the rest to blocks."""
    if not shape:
        return []
    inner = shape[-1]
    t = min(THREADS, 1 << max(0, math.ceil(math.log2(max(inner, 1)))))
    tiles = [1] * len(shape)
    tiles[-1] = t
    if t < THREADS and len(shape) >= 2:  # short rows: several rows per block
        tiles[-2] = max(1, min(shape[-2], THREADS // t))
    return tiles


def _par_shapes(func_op: Any) -> list[list[int]]:
    """The loop ranges of each top-level scf.parallel in a function (constant bounds)."""
    out = []
    for op in func_op.regions[0].blocks[0].operations:
        if op.operation.name == "scf.parallel":
            ub = []
            for v in op.operation.operands[len(op.operation.operands) // 3 :][
                : len(op.operation.operands) // 3
            ]:
                ub.append(_const_int(v))
            out.append(ub)
    return out


def _const_float(v: Any) -> float:
    from mlir import ir

    return ir.FloatAttr(v.owner.attributes["value"]).value


def _const_int(v: Any) -> int:
    """An index / integer arith.constant's value; -1 for anything else (a dynamic size)."""
    from mlir import ir

    owner = v.owner
    if getattr(owner, "name", None) != "arith.constant":
        return -1
    try:
        return int(ir.IntegerAttr(owner.attributes["value"]).value)
    except (TypeError, ValueError):
        return -1


def _half_bits(v: Any, ty: str) -> int:
    """The 16-bit pattern of a bf16 / f16 arith.constant (Note [16-bit kernel scalars])."""
    import numpy as np

    x = _const_float(v)
    if ty == "f16":
        return int(np.array(x, dtype=np.float16).view(np.uint16))
    bits = int(np.array(x, dtype=np.float32).view(np.uint32))  # exact: the constant is a bf16
    return bits >> 16


# Note [16-bit kernel scalars]: a bf16 / f16 constant the host passes to a kernel (a fill's
# value: zeros for a bf16 gradient) is a 2-byte parameter. The launcher gives every parameter
# an 8-byte slot and the driver copies the parameter's own size from it, so the slot holds
# the 16-bit pattern in its low bytes. (It once held -1, the integer parse of '0.0 : bf16'
# failing: every bf16 zero-fill wrote NaN; session 46, H100, GPT-2's compiled bf16 step.)


def map_to_gpu(module: Any) -> None:
    """Per function: parallel loops tiled by our block shape and mapped to blocks and threads,
    the innermost (contiguous) dimension on x so a warp reads consecutive elements."""
    from mlir import ir
    from mlir.dialects import func
    from mlir.passmanager import PassManager

    for op in module.body.operations:
        if not isinstance(op.opview, func.FuncOp):
            continue
        PassManager.parse("func.func(convert-linalg-to-parallel-loops, canonicalize)").run(
            op.operation
        )
        shapes = _par_shapes(op.opview)
        biggest = (
            max(shapes, key=lambda s: (len(s), math.prod(max(x, 1) for x in s))) if shapes else []
        )
        tiles = tile_sizes(biggest)
        tiling = (
            f"scf-parallel-loop-tiling{{parallel-loop-tile-sizes={','.join(map(str, tiles))}}},"
            if tiles
            else ""
        )
        PassManager.parse(f"func.func({tiling} gpu-map-parallel-loops)").run(op.operation)
        _innermost_on_x(op.operation, ir)


def _innermost_on_x(root: Any, ir: Any) -> None:
    """gpu-map-parallel-loops puts loop dim 0 on x; reverse so the last dim is on x."""

    def walk(o: Any) -> None:
        for r in o.regions:
            for b in r.blocks:
                for c in b.operations:
                    if c.operation.name == "scf.parallel" and "mapping" in c.operation.attributes:
                        m = c.operation.attributes["mapping"]
                        items = [str(m[i]) for i in range(len(m))]
                        n = len(items)
                        if 1 < n <= 3:
                            procs = [_proc(x) for x in items]
                            kind = procs[0][:-1]  # block_ / thread_
                            if all(p[:-1] == kind for p in procs):
                                new = [
                                    x.replace(
                                        f"processor = {procs[i]}",
                                        f"processor = {kind}{'xyz'[n - 1 - i]}",
                                    )
                                    for i, x in enumerate(items)
                                ]
                                c.operation.attributes["mapping"] = ir.ArrayAttr.get(
                                    [ir.Attribute.parse(x) for x in new]
                                )
                    walk(c.operation)

    walk(root)


def _proc(s: str) -> str:
    return s.split("processor = ")[1].split(",")[0].strip()


def device_pipeline() -> str:
    ld = libdevice()
    link = f" l={ld}" if ld else ""
    return (
        f"builtin.module(nvvm-attach-target{{chip={CHIP} features={FEATURES} O=3{link}}}, "
        "convert-scf-to-cf, expand-strided-metadata, lower-affine, "
        "gpu.module(convert-gpu-to-nvvm{use-bare-ptr-memref-call-conv=1}, canonicalize, cse, "
        "reconcile-unrealized-casts), gpu-module-to-binary{format=isa})"
    )


OUTLINE = "builtin.module(convert-parallel-loops-to-gpu, gpu-kernel-outlining, canonicalize, cse)"
TO_GPU = "builtin.module(convert-parallel-loops-to-gpu)"
OUTLINE_ONLY = "builtin.module(gpu-kernel-outlining, canonicalize, cse)"
VIEW_OPS = (
    "memref.subview",
    "memref.expand_shape",
    "memref.collapse_shape",
    "memref.cast",
    "memref.reinterpret_cast",
)


def sink_views(module: Any) -> int:
    """Clones the view ops (subviews of slices, reshapes) a gpu.launch reads into its body, so
    the kernel takes the underlying buffers (identity layouts: one bare pointer each) and
    computes the view itself. Returns how many were sunk."""
    from mlir import ir
    from mlir.dialects import func

    count = 0

    def inside(op: Any, launch: Any) -> bool:
        p = getattr(op, "operation", op)
        while p is not None:
            if p == launch:
                return True
            p = getattr(p, "parent", None)
            p = getattr(p, "operation", p) if p is not None else None
        return False

    for fop in module.body.operations:
        if not isinstance(fop.opview, func.FuncOp):
            continue
        for o in list(fop.regions[0].blocks[0].operations):
            if o.operation.name != "gpu.launch":
                continue
            launch = o.operation
            body = launch.regions[0].blocks[0]
            changed = True
            while changed:
                changed = False
                for inner in _walk(launch):
                    for v in inner.operands:
                        d = v.owner
                        if isinstance(d, ir.Block):
                            continue
                        d = getattr(d, "operation", d)
                        if d.name not in VIEW_OPS:
                            continue
                        if inside(d, launch):
                            continue
                        first = list(body.operations)[0]
                        c = d.clone(ip=ir.InsertionPoint(first))
                        for u in list(v.uses):
                            if inside(u.owner, launch):
                                u.owner.operands[u.operand_number] = c.results[0]
                        count += 1
                        changed = True
                        break
                    if changed:
                        break
    return count


def _walk(op: Any) -> list[Any]:
    out = []
    for r in op.regions:
        for b in r.blocks:
            for c in b.operations:
                out.append(c.operation)
                out.extend(_walk(c.operation))
    return out


def _kernel_access(kfn: Any) -> list[tuple[bool, bool]]:
    """(reads, writes) of each memref parameter of an outlined gpu.func, through the views
    the kernel takes of it."""
    from mlir import ir

    params = list(kfn.regions[0].blocks[0].arguments)
    root: dict[Any, int] = {a: i for i, a in enumerate(params)}
    acc = [[False, False] for _ in params]

    def walk(op: Any) -> None:
        for r in op.regions:
            for b in r.blocks:
                for inner in b.operations:
                    o = inner.operation
                    nm = o.name
                    if nm in VIEW_OPS and o.operands[0] in root:
                        root[o.results[0]] = root[o.operands[0]]
                    elif nm in ("memref.load", "vector.load", "vector.transfer_read"):
                        if o.operands[0] in root:
                            acc[root[o.operands[0]]][0] = True
                    elif nm in ("memref.store", "vector.store", "vector.transfer_write"):
                        if o.operands[1] in root:
                            acc[root[o.operands[1]]][1] = True
                    elif nm in ("memref.atomic_rmw", "memref.generic_atomic_rmw"):
                        for v in o.operands:
                            if v in root:
                                acc[root[v]] = [True, True]
                    else:
                        for v in o.operands:  # anything else: counted as both (conservative)
                            if v in root and isinstance(v.type, ir.MemRefType):
                                acc[root[v]] = [True, True]
                    walk(o)

    walk(kfn.operation)
    return [(r, w) for r, w in acc]


def _gpu_funcs(module: Any) -> dict[tuple[str, str], Any]:
    """(gpu.module symbol, kernel symbol) -> the outlined gpu.func."""
    out: dict[tuple[str, str], Any] = {}
    for op in module.body.operations:
        if op.operation.name != "gpu.module":
            continue
        mname = op.operation.attributes["sym_name"].value
        for k in op.regions[0].blocks[0].operations:
            if k.operation.name == "gpu.func":
                out[(mname, k.operation.attributes["sym_name"].value)] = k
    return out


def unwritten_reads(module: Any) -> list[str]:
    """Note [no read of an unwritten temporary]: after outlining, each host function's kernels
    in launch order; a kernel that reads a temporary (a memref.alloc of the host function)
    which no earlier kernel and not the kernel itself writes reads memory nothing wrote: a
    codegen bug, reported here (compile_module raises) instead of as a wrong or NaN result
    at run time. (rowgen dropped such a store once: Note [views of register values].)"""
    from mlir.dialects import func

    kernels = {name: _kernel_access(k) for name, k in _gpu_funcs(module).items()}
    bad: list[str] = []
    for op in module.body.operations:
        if not isinstance(op.opview, func.FuncOp):
            continue
        fname = op.opview.name.value
        temp_of: dict[Any, Any] = {}
        written: set[Any] = set()
        for o in op.regions[0].blocks[0].operations:
            nm = o.operation.name
            if nm == "memref.alloc":
                temp_of[o.operation.results[0]] = o.operation.results[0]
            elif nm in VIEW_OPS and o.operation.operands[0] in temp_of:
                temp_of[o.operation.results[0]] = temp_of[o.operation.operands[0]]
            elif nm == "gpu.launch_func":
                mod, ker = [x.strip("@") for x in str(o.operation.attributes["kernel"]).split("::")]
                access = kernels.get((mod, ker))
                if access is None:
                    continue
                for v, (r, w) in zip(list(o.opview.kernelOperands), access):
                    t = temp_of.get(v)
                    if t is not None and r and not w and t not in written:
                        bad.append(
                            f"{fname}: kernel {mod} reads temporary {t.get_name()} "
                            "that no kernel before it wrote"
                        )
                for v, (_, w) in zip(list(o.opview.kernelOperands), access):
                    if w and v in temp_of:
                        written.add(temp_of[v])
    return bad


# Note [outputs over dead inputs]: eager writes a loss's dlogits over the logits when nothing
# else holds them (blutrain.tensor's Note [donating a saved input]); a compiled step that keeps
# both holds a second vocabulary-sized buffer at its peak (500 MiB for LLaMA small's B8 x T512
# step). The plan (program.py, Note [shared buffers]) may give a group's output the buffer of an
# input that dies at that group, when the kernels allow it: `inplace_pairs` says when.
# Conservative, for row groups (rowgen) only, where element (row, j) of a row is handled by one
# thread in every pass (block = row, j from thread_id with the block size as step), so a load
# and a store at the same (row, j) happen in one thread in program order. Output o may take
# input x's memory when, in the host function:
#   - o and x are arguments of the same memref type, x only read, o written by one launch w;
#   - no launch after w reads x (launches run in order on one stream);
#   - in w's kernel, o has exactly one store, x and o are used without views, and every load
#     of x has the store's row indices and, last, the induction variable of a loop with the
#     store loop's bounds and step, placed before the store: each thread reads its elements of
#     x before it overwrites them, and no thread reads another's.
# A gather of x at other positions (cross-entropy's pick of the target logit) is fine in an
# earlier launch, never in w.


def _loads_before_store(kfn: Any, xi: int, oi: int) -> bool:
    from mlir import ir

    params = list(kfn.regions[0].blocks[0].arguments)
    xp, op_ = params[xi], params[oi]
    seq: list[Any] = []  # pre-order walk: program order of the kernel's ops

    def walk(o: Any) -> None:
        for r in o.regions:
            for b in r.blocks:
                for inner in b.operations:
                    seq.append(inner.operation)
                    walk(inner.operation)

    walk(kfn.operation)
    stores, loads = [], []
    for pos, o in enumerate(seq):
        uses_x = any(v == xp for v in o.operands)
        uses_o = any(v == op_ for v in o.operands)
        if not (uses_x or uses_o):
            continue
        if o.name == "memref.store" and o.operands[1] == op_ and not uses_x:
            stores.append((pos, o))
        elif o.name == "memref.load" and o.operands[0] == xp and not uses_o:
            loads.append((pos, o))
        else:
            return False  # a view, a vector access, an atomic: not this simple pattern
    if len(stores) != 1 or not loads:
        return False
    spos, st = stores[0]
    sidx = list(st.operands)[2:]
    if not sidx:
        return False

    def loop_of(v: Any) -> Any:  # the scf.for whose induction variable v is, or None
        v = v.maybe_downcast()
        if not isinstance(v, ir.BlockArgument):
            return None
        owner = v.owner.owner  # the block's parent op
        return owner if owner is not None and owner.name == "scf.for" else None

    sloop = loop_of(sidx[-1])
    if sloop is None:
        return False
    for lpos, ld in loads:
        lidx = list(ld.operands)[1:]
        if lpos > spos or len(lidx) != len(sidx):
            return False
        if any(a != b for a, b in zip(lidx[:-1], sidx[:-1])):
            return False
        if lidx[-1] != sidx[-1]:
            lloop = loop_of(lidx[-1])
            if lloop is None or list(lloop.operands)[:3] != list(sloop.operands)[:3]:
                return False
    return True


def inplace_pairs(module: Any, row_functions: set[str]) -> dict[str, list[tuple[int, int]]]:
    """Per host function of a row group: the (output argument, input argument) pairs whose
    output may be written over the input (Note [outputs over dead inputs])."""
    from mlir.dialects import func

    kernels = _gpu_funcs(module)
    out: dict[str, list[tuple[int, int]]] = {}
    for op in module.body.operations:
        if not isinstance(op.opview, func.FuncOp) or op.opview.name.value not in row_functions:
            continue
        f = op.opview
        fargs = list(f.arguments)
        launches = []  # (kernel op, operand -> function argument index, access)
        for o in f.regions[0].blocks[0].operations:
            if o.operation.name != "gpu.launch_func":
                continue
            mod, ker = [x.strip("@") for x in str(o.operation.attributes["kernel"]).split("::")]
            k = kernels.get((mod, ker))
            if k is None:
                break
            which = [
                next((i for i, a in enumerate(fargs) if a == v), -1)
                for v in o.opview.kernelOperands
            ]
            launches.append((k, which, _kernel_access(k)))
        else:
            pairs = []
            for oi, oa in enumerate(fargs):
                for xi, xa in enumerate(fargs):
                    if oi == xi or str(oa.type) != str(xa.type) or "memref" not in str(oa.type):
                        continue
                    pairs += _pair_ok(launches, oi, xi)
            if pairs:
                out[f.name.value] = pairs
    return out


def _pair_ok(launches: list, oi: int, xi: int) -> list[tuple[int, int]]:
    writers = [
        n
        for n, (_, w, acc) in enumerate(launches)
        if any(a == oi and acc[p][1] for p, a in enumerate(w))
    ]
    if len(writers) != 1:
        return []
    wn = writers[0]
    for n, (_, w, acc) in enumerate(launches):
        for p, a in enumerate(w):
            if a == xi and acc[p][1]:
                return []  # x is written: not an input only read
            if a == xi and acc[p][0] and n > wn:
                return []
    k, w, _ = launches[wn]
    if w.count(oi) != 1 or w.count(xi) > 1:
        return []
    if xi not in w:
        return [(oi, xi)]  # w does not read x at all
    return [(oi, xi)] if _loads_before_store(k, w.index(xi), w.index(oi)) else []


def read_host(module: Any) -> dict[str, GpuFunction]:
    """The launches and temporaries of every host function, in order."""
    from mlir.dialects import func

    fns: dict[str, GpuFunction] = {}
    for op in module.body.operations:
        if not isinstance(op.opview, func.FuncOp):
            continue
        f = op.opview
        gf = GpuFunction(f.name.value)
        args = {a.get_name(): i for i, a in enumerate(f.arguments)}
        temps: dict[str, int] = {}
        for o in f.regions[0].blocks[0].operations:
            nm = o.operation.name
            if nm == "memref.alloc":
                t = o.operation.results[0].type
                from mlir import ir

                mt = ir.MemRefType(t)
                shape = tuple(mt.shape)
                el = str(mt.element_type)
                bits = {
                    "f32": 32,
                    "f64": 64,
                    "i64": 64,
                    "i32": 32,
                    "i8": 8,
                    "f16": 16,
                    "bf16": 16,
                    "i1": 8,
                }[el]
                temps[o.operation.results[0].get_name()] = len(gf.temps)
                gf.temps.append((shape, el, max(1, math.prod(shape)) * bits // 8))
            elif nm == "gpu.launch_func":
                a = o.operation.attributes
                kref = str(a["kernel"])  # @module::@kernel
                mod, ker = [s.strip("@") for s in kref.split("::")]
                lf = o.opview
                grid = (
                    _const_int(lf.gridSizeX),
                    _const_int(lf.gridSizeY),
                    _const_int(lf.gridSizeZ),
                )
                block = (
                    _const_int(lf.blockSizeX),
                    _const_int(lf.blockSizeY),
                    _const_int(lf.blockSizeZ),
                )
                kargs = list(lf.kernelOperands)
                operands: list[tuple[str, int]] = []
                for v in kargs:
                    n = v.get_name()
                    if n in args:
                        operands.append(("arg", args[n]))
                    elif n in temps:
                        operands.append(("tmp", temps[n]))
                    else:
                        ty = str(v.type)
                        if getattr(v.owner, "name", None) != "arith.constant":
                            raise RuntimeError(f"[compile] kernel operand {n} of unknown origin")
                        if ty in ("f32", "f64"):
                            operands.append((ty, _const_float(v)))  # type: ignore[arg-type]
                        elif ty in ("bf16", "f16"):
                            operands.append(("b16", _half_bits(v, ty)))
                        elif ty == "index" or ty.startswith("i"):
                            operands.append(("int", _const_int(v)))
                        else:
                            raise RuntimeError(
                                f"[compile] kernel operand {n} of type {ty}: no launch rule"
                            )
                gf.launches.append(Launch(ker, mod, grid, block, operands))  # type: ignore[arg-type]
            elif nm in VIEW_OPS and not list(o.operation.results[0].uses):
                continue  # sunk into the kernels that read it
            elif nm in ("memref.collapse_shape", "memref.expand_shape", "memref.cast"):
                src = o.operation.operands[0].get_name()
                res = o.operation.results[0].get_name()
                if src in args:
                    args[res] = args[src]
                elif src in temps:
                    temps[res] = temps[src]
                else:
                    raise RuntimeError(f"[compile] view {nm} of unknown origin")
            elif nm in ("memref.dealloc", "arith.constant", "func.return"):
                continue
            elif nm.startswith("arith.") or nm.startswith("affine."):
                continue
            else:
                raise RuntimeError(f"[compile] host op {nm} left after outlining in {gf.name}")
        fns[gf.name] = gf
    return fns


def binaries(module: Any) -> dict[str, str]:
    """gpu.module symbol -> PTX text, from each gpu.binary's object."""
    from mlir.dialects import gpu

    out = {}
    for op in module.body.operations:
        if op.operation.name == "gpu.binary":
            name = str(op.operation.attributes["sym_name"]).strip('"')
            objs = op.operation.attributes["objects"]
            obj = gpu.ObjectAttr(objs[0])
            data = obj.object
            out[name] = data.decode() if isinstance(data, bytes) else str(data)
    return out


@dataclass
class GpuCode:
    """Per group (function name): its launches and temporaries, and the PTX of every module."""

    functions: dict[str, GpuFunction]
    ptx: dict[str, str]
    unsupported: dict[str, str]  # function -> why its host side cannot be replayed
    row_kernels: dict[str, int] = field(default_factory=dict)  # function -> threads (rowgen)

    def to_json(self) -> str:
        import json

        return json.dumps(
            {
                "functions": {
                    k: {
                        "launches": [
                            [
                                ln.kernel,
                                ln.module,
                                list(ln.grid),
                                list(ln.block),
                                [list(o) for o in ln.operands],
                            ]
                            for ln in f.launches
                        ],
                        "temps": [[list(sh), el, nb] for sh, el, nb in f.temps],
                        "inplace": [list(p) for p in f.inplace],
                    }
                    for k, f in self.functions.items()
                },
                "ptx": self.ptx,
                "row_kernels": self.row_kernels,
            }
        )

    @staticmethod
    def from_json(text: str) -> GpuCode:
        import json

        d = json.loads(text)
        fns = {}
        for k, f in d["functions"].items():
            gf = GpuFunction(k)
            gf.launches = [
                Launch(a, b, tuple(c), tuple(e), [(o[0], o[1]) for o in ops])
                for a, b, c, e, ops in f["launches"]
            ]
            gf.temps = [(tuple(sh), el, nb) for sh, el, nb in f["temps"]]
            gf.inplace = [(int(a), int(b)) for a, b in f.get("inplace", [])]
            fns[k] = gf
        return GpuCode(fns, d["ptx"], {}, d.get("row_kernels", {}))


def compile_module(module: Any, dump: Any = None, stage_s: dict | None = None) -> GpuCode:
    """Bufferized module (one function per group) -> launches + PTX for sm_90."""
    import time

    from mlir.dialects import func as _func
    from mlir.passmanager import PassManager

    from . import rowgen

    t = time.perf_counter()
    row_threads: dict[str, int] = {}
    for op in list(module.body.operations):
        if isinstance(op.opview, _func.FuncOp):
            T = rowgen.apply(op.opview)
            if T is not None:
                row_threads[op.opview.name.value] = T
    if dump:
        dump.write("03-gpu-rows.mlir", str(module))
    map_to_gpu(module)
    PassManager.parse(TO_GPU).run(module.operation)
    sink_views(module)
    PassManager.parse(OUTLINE_ONLY).run(module.operation)
    if dump:
        dump.write("04-gpu-mapped.mlir", str(module))
    bad = unwritten_reads(module)
    if bad:
        raise RuntimeError("[compile] GPU codegen: " + "; ".join(bad[:8]))
    pairs = inplace_pairs(module, set(row_threads))
    fns: dict[str, GpuFunction] = {}
    unsupported: dict[str, str] = {}
    from mlir.dialects import func

    for op in list(module.body.operations):
        if isinstance(op.opview, func.FuncOp):
            name = op.opview.name.value
            try:
                fns.update(read_host_one(op.opview))
                fns[name].inplace = pairs.get(name, [])
            except RuntimeError as e:
                unsupported[name] = str(e)
    PassManager.parse(device_pipeline()).run(module.operation)
    ptx = binaries(module)
    if dump:
        dump.write("05-gpu-binary.mlir", str(module)[:200000])
        for k, v in ptx.items():
            dump.write(f"ptx/{k}.ptx", v)
    if stage_s is not None:
        stage_s["ptx"] = time.perf_counter() - t
    return GpuCode(fns, ptx, unsupported, row_threads)


def read_host_one(f: Any) -> dict[str, GpuFunction]:
    class _M:
        pass

    m = _M()
    m.body = _M()  # type: ignore[attr-defined]
    m.body.operations = [f]  # type: ignore[attr-defined]
    return read_host(m)


class GpuKernel:
    """Runs one group's launches on blutrain.tensor's current stream (CUDA driver API)."""

    def __init__(self, fn: GpuFunction, modules: dict[str, Any], device: str) -> None:
        self.fn = fn
        self.device = device
        self.handles = [modules[ln.module].function(ln.kernel) for ln in fn.launches]
        self.temps: list[Any] = []
        # addresses of the temporaries in the program's arena, set by Program._arena_views
        # (Note [kernel temporaries in the arena]); None: the kernel allocates its own once
        self.temp_ptrs: list[int] | None = None

    def __call__(self, ptrs: list[int]) -> None:
        import struct

        import blutrain.tensor as bt

        from . import _runtime

        tptr = self.temp_ptrs
        if tptr is None:
            if not self.temps:
                self.temps = [
                    bt.empty((max(1, nbytes),), dtype=bt.uint8, device=self.device)
                    for _, _, nbytes in self.fn.temps
                ]
            tptr = [t.data_ptr() for t in self.temps]
        stream = int(bt._tensor._cuda_current_stream(_dev_index(self.device)))
        for h, ln in zip(self.handles, self.fn.launches):
            kinds, vals = [], []
            for kind, v in ln.operands:
                if kind == "arg":
                    kinds.append("p")
                    vals.append(ptrs[v])
                elif kind == "tmp":
                    kinds.append("p")
                    vals.append(tptr[v])
                elif kind == "f32":
                    kinds.append("f")
                    vals.append(struct.unpack("<I", struct.pack("<f", v))[0])
                elif kind == "f64":
                    kinds.append("q")
                    vals.append(struct.unpack("<q", struct.pack("<d", v))[0])
                else:
                    kinds.append("q")
                    vals.append(int(v))
            _runtime.launch(h, list(ln.grid), list(ln.block), 0, stream, "".join(kinds), vals)


def _dev_index(device: str) -> int:
    return int(device.split(":")[1]) if ":" in device else 0
