"""Scalar arithmetic inside linalg bodies: dtype-aware arith/math builders.

Float32 exp and tanh are built from the same Cephes polynomials as blutrain.tensor's CPU kernels
(cpu/fastmath.h), so compiled and eager float32 results agree to the last bit or two, and no
libm / libdevice call is needed on any target.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, math

FLOATS = ("float16", "bfloat16", "float32", "float64")


def mlir_type(dtype: str) -> ir.Type:
    return {
        "bool": lambda: ir.IntegerType.get_signless(1),
        "uint8": lambda: ir.IntegerType.get_signless(8),
        "int32": lambda: ir.IntegerType.get_signless(32),
        "int64": lambda: ir.IntegerType.get_signless(64),
        "float16": ir.F16Type.get,
        "bfloat16": ir.BF16Type.get,
        "float32": ir.F32Type.get,
        "float64": ir.F64Type.get,
    }[dtype]()


def storage_type(dtype: str) -> ir.Type:
    """The element type in memory: bool is a byte (LLVM cannot store i1 memrefs)."""
    return ir.IntegerType.get_signless(8) if dtype == "bool" else mlir_type(dtype)


def load_bool(x: ir.Value) -> ir.Value:
    return arith.trunci(ir.IntegerType.get_signless(1), x)


def store_bool(x: ir.Value) -> ir.Value:
    return arith.extui(ir.IntegerType.get_signless(8), x)


def compute_dtype(dtype: str) -> str:
    """What eager kernels compute in: float32 for 16-bit floats, the dtype otherwise."""
    return "float32" if dtype in ("float16", "bfloat16") else dtype


def is_float(dtype: str) -> bool:
    return dtype in FLOATS


def const(dtype: str, v: float | int | bool) -> ir.Value:
    t = mlir_type(dtype)
    if is_float(dtype):
        return arith.constant(t, float(v))
    if dtype == "bool":
        return arith.constant(t, 1 if v else 0)
    return arith.constant(t, int(v))


def cast(x: ir.Value, src: str, dst: str) -> ir.Value:
    """Convert a scalar as eager astype does (float->int truncates, ->bool is != 0)."""
    if src == dst:
        return x
    t = mlir_type(dst)
    if dst == "bool":
        z = const(src, 0)
        if is_float(src):
            return arith.cmpf(arith.CmpFPredicate.UNE, x, z)
        return arith.cmpi(arith.CmpIPredicate.ne, x, z)
    if is_float(src) and is_float(dst):
        wsrc, wdst = _fbits(src), _fbits(dst)
        if wdst > wsrc:
            return arith.extf(t, x)
        if wdst < wsrc or src != dst:
            if {src, dst} == {"float16", "bfloat16"}:
                return arith.truncf(t, arith.extf(ir.F32Type.get(), x))
            if src == "float64" and wdst == 16:
                # eager's 16-bit floats convert a double through float (dtype.h), two roundings;
                # a direct f64 -> bf16 truncf is another value, and a compiler-rt call
                # (__truncdfbf2) the CPU JIT does not resolve
                return arith.truncf(t, arith.truncf(ir.F32Type.get(), x))
            return arith.truncf(t, x)
        return x
    if is_float(src):
        return arith.fptoui(t, x) if dst == "uint8" else arith.fptosi(t, x)
    if is_float(dst):
        return arith.uitofp(t, x) if src in ("bool", "uint8") else arith.sitofp(t, x)
    ws, wd = _ibits(src), _ibits(dst)
    if wd > ws:
        return arith.extui(t, x) if src in ("bool", "uint8") else arith.extsi(t, x)
    if wd < ws:
        return arith.trunci(t, x)
    return x


def _fbits(d: str) -> int:
    return {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}[d]


def _ibits(d: str) -> int:
    return {"bool": 1, "uint8": 8, "int32": 32, "int64": 64}[d]


def select(c: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:
    return arith.select(c, a, b)


def cmp(pred: str, a: ir.Value, b: ir.Value, dtype: str) -> ir.Value:
    if is_float(dtype):
        p = {
            "eq": arith.CmpFPredicate.OEQ,
            "ne": arith.CmpFPredicate.UNE,
            "lt": arith.CmpFPredicate.OLT,
            "le": arith.CmpFPredicate.OLE,
            "gt": arith.CmpFPredicate.OGT,
            "ge": arith.CmpFPredicate.OGE,
        }[pred]
        return arith.cmpf(p, a, b)
    uns = dtype in ("bool", "uint8")
    p = {
        "eq": arith.CmpIPredicate.eq,
        "ne": arith.CmpIPredicate.ne,
        "lt": arith.CmpIPredicate.ult if uns else arith.CmpIPredicate.slt,
        "le": arith.CmpIPredicate.ule if uns else arith.CmpIPredicate.sle,
        "gt": arith.CmpIPredicate.ugt if uns else arith.CmpIPredicate.sgt,
        "ge": arith.CmpIPredicate.uge if uns else arith.CmpIPredicate.sge,
    }[pred]
    return arith.cmpi(p, a, b)


def add(a: ir.Value, b: ir.Value, dtype: str) -> ir.Value:
    return arith.addf(a, b) if is_float(dtype) else arith.addi(a, b)


def sub(a: ir.Value, b: ir.Value, dtype: str) -> ir.Value:
    return arith.subf(a, b) if is_float(dtype) else arith.subi(a, b)


def mul(a: ir.Value, b: ir.Value, dtype: str) -> ir.Value:
    return arith.mulf(a, b) if is_float(dtype) else arith.muli(a, b)


def div(a: ir.Value, b: ir.Value, dtype: str) -> ir.Value:
    if is_float(dtype):
        return arith.divf(a, b)
    return arith.divui(a, b) if dtype in ("bool", "uint8") else arith.divsi(a, b)


def maximum(a: ir.Value, b: ir.Value, dtype: str) -> ir.Value:
    # eager: a > b ? a : b with NaN propagation (maximumf: NaN if either is NaN)
    if is_float(dtype):
        return arith.maximumf(a, b)
    return arith.maxui(a, b) if dtype in ("bool", "uint8") else arith.maxsi(a, b)


def minimum(a: ir.Value, b: ir.Value, dtype: str) -> ir.Value:
    if is_float(dtype):
        return arith.minimumf(a, b)
    return arith.minui(a, b) if dtype in ("bool", "uint8") else arith.minsi(a, b)


def neg(a: ir.Value, dtype: str) -> ir.Value:
    return arith.negf(a) if is_float(dtype) else arith.subi(const(dtype, 0), a)


def _bits(x: ir.Value) -> ir.Value:
    return arith.bitcast(ir.IntegerType.get_signless(32), x)


def _host_has_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return " fma " in line + " "
    except OSError:
        pass
    return False


# Note [FMA like eager]: blutrain.tensor builds its elementwise and softmax loops as GCC target
# clones (x86-64-v3 / v4 where the CPU has them), and GCC contracts a * b + c into one fused
# multiply-add there (-ffp-contract=fast). fast_exp / fast_tanh / gelu_tanh below contract the
# same products, so compiled float32 results are eager's bit for bit on such a CPU.
FMA = _host_has_fma()


def _madd(a: ir.Value, b: ir.Value, c: ir.Value, fma: bool | None = None) -> ir.Value:
    """a * b + c, fused where eager's compiler fuses it (Note [FMA like eager])."""
    fused = FMA if fma is None else fma
    return math.fma(a, b, c) if fused else arith.addf(arith.mulf(a, b), c)


def fast_exp(x: ir.Value, fma: bool | None = None) -> ir.Value:
    """cpu/fastmath.h's fast_exp, operation for operation (float32). fma=False: as eager's
    -ffp-contract=off files compile it (the softmax / cross-entropy backwards in nn_fused.cpp);
    None: as the contracting ones do on this CPU (Note [FMA like eager])."""
    f = ir.F32Type.get()

    def c(v: float) -> ir.Value:
        return arith.constant(f, v)

    hi, lo = c(88.72283905206835), c(-87.3365447504)
    gt = arith.cmpf(arith.CmpFPredicate.OGT, x, hi)
    lt = arith.cmpf(arith.CmpFPredicate.OLT, x, lo)
    xc = arith.select(gt, hi, arith.select(lt, lo, x))
    t = arith.mulf(xc, c(1.44269504088896341))
    big = c(12582912.0)
    fn = arith.subf(arith.addf(t, big), big)
    i32 = ir.IntegerType.get_signless(32)
    n = arith.fptosi(i32, fn)
    nfn = arith.negf(fn)
    r = _madd(nfn, c(0.693359375), xc, fma)
    r = _madd(nfn, c(-2.12194440e-4), r, fma)
    z = arith.mulf(r, r)
    y = c(1.9875691500e-4)
    for k in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        y = _madd(y, r, c(k), fma)
    y = arith.addf(_madd(y, z, r, fma), c(1.0))
    bits = arith.shli(arith.addi(n, arith.constant(i32, 126)), arith.constant(i32, 23))
    p2 = arith.bitcast(f, bits)
    res = arith.mulf(arith.mulf(y, p2), c(2.0))
    res = arith.select(gt, c(float("inf")), res)
    res = arith.select(lt, c(0.0), res)
    nan = arith.cmpf(arith.CmpFPredicate.UNO, x, x)
    return arith.select(nan, x, res)


def fast_tanh(x: ir.Value) -> ir.Value:
    """cpu/fastmath.h's fast_tanh (float32)."""
    f = ir.F32Type.get()

    def c(v: float) -> ir.Value:
        return arith.constant(f, v)

    neg_ = arith.cmpf(arith.CmpFPredicate.OLT, x, c(0.0))
    ax = arith.select(neg_, arith.negf(x), x)
    z = arith.mulf(x, x)
    p = c(-5.70498872745e-3)
    for k in (2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1, -3.33332819422e-1):
        p = _madd(p, z, c(k))
    small = _madd(arith.mulf(p, z), x, x)
    axc = arith.select(arith.cmpf(arith.CmpFPredicate.OGT, ax, c(20.0)), c(20.0), ax)
    e = fast_exp(arith.mulf(c(2.0), axc))
    big = arith.subf(c(1.0), arith.divf(c(2.0), arith.addf(e, c(1.0))))
    big = arith.select(neg_, arith.negf(big), big)
    r = arith.select(arith.cmpf(arith.CmpFPredicate.OLT, ax, c(0.625)), small, big)
    nan = arith.cmpf(arith.CmpFPredicate.UNO, x, x)
    return arith.select(nan, x, r)


def exp(x: ir.Value, dtype: str, fma: bool | None = None) -> ir.Value:
    """Eager's exp_c in compute type `dtype` (fma: see fast_exp)."""
    return fast_exp(x, fma) if dtype == "float32" else math.exp(x)


def tanh(x: ir.Value, dtype: str) -> ir.Value:
    return fast_tanh(x) if dtype == "float32" else math.tanh(x)


def unary(op: str, x: ir.Value, dtype: str) -> ir.Value:
    """Eager's unary_fn for compute dtype `dtype` (cpu/elementwise.cpp)."""
    f = is_float(dtype)

    def c(v: float) -> ir.Value:
        return const(dtype, v)

    if op == "neg":
        return neg(x, dtype)
    if op == "abs":
        return math.absf(x) if f else arith.select(cmp("lt", x, c(0), dtype), neg(x, dtype), x)
    if op == "relu":
        return arith.select(cmp("gt", x, c(0), dtype), x, c(0))
    if op == "sign":
        pos = cast(cmp("gt", x, c(0), dtype), "bool", dtype)
        ng = cast(cmp("lt", x, c(0), dtype), "bool", dtype)
        return sub(pos, ng, dtype)
    if op == "logical_not":
        return cast(cmp("eq", x, c(0), dtype), "bool", dtype)
    if not f:
        raise NotImplementedError(op)
    if op == "exp":
        return exp(x, dtype)
    if op == "tanh":
        return tanh(x, dtype)
    if op == "sigmoid":
        return arith.divf(c(1.0), arith.addf(c(1.0), exp(arith.negf(x), dtype)))
    if op == "gelu_tanh":
        k = c(0.7978845608028654)
        cube = arith.mulf(arith.mulf(c(0.044715), x), x)
        inner = arith.mulf(
            k, _madd(cube, x, x) if dtype == "float32" else arith.addf(x, arith.mulf(cube, x))
        )
        return arith.mulf(arith.mulf(c(0.5), x), arith.addf(c(1.0), tanh(inner, dtype)))
    if op == "log":
        return math.log(x)
    if op == "sqrt":
        return math.sqrt(x)
    if op == "rsqrt":
        return arith.divf(c(1.0), math.sqrt(x))
    if op == "sin":
        return math.sin(x)
    if op == "cos":
        return math.cos(x)
    if op == "erf":
        return math.erf(x)
    if op in ("gelu", "gelu_erf"):
        e = math.erf(arith.mulf(x, c(0.7071067811865476)))
        return arith.mulf(arith.mulf(c(0.5), x), arith.addf(c(1.0), e))
    raise NotImplementedError(op)
