"""CPU code: fused linalg -> loops -> LLVM, JIT-compiled by MLIR's ExecutionEngine.

Kernels are called through their C interface (`_mlir_ciface_<name>(desc*...)`, one memref
descriptor per input, then one per output). The descriptors are ctypes structs built once per
compiled program; a call only rewrites the data pointers that changed.

The disk cache keeps each module's object file (ExecutionEngine.dump_to_object_file) linked into
a shared library (`cc -shared`), so a second process loads compiled code with ctypes and runs
no compiler at all; where no C compiler is found it keeps the LLVM-dialect module text and
re-JITs that.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from typing import Any

_DESC: dict[int, type] = {}
_OMP: list[Any] = []  # [the loaded libbtc_omp, or None where it is missing]


def omp_threads() -> int:
    """Loads the OpenMP entry points of parallel kernels (src/kmp_pool.c) with RTLD_GLOBAL, once,
    so the JIT and cached kernel libraries resolve them, and attaches them to blutrain.tensor's
    CPU thread pool (one pool, one budget: bt.set_num_threads); the threads a fork uses now, or 0
    where the library is missing (kernels are then compiled serial)."""
    if not _OMP:
        lib = None
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libbtc_omp.so")
        try:
            from . import _runtime

            path = os.path.join(os.path.dirname(_runtime.__file__), "libbtc_omp.so")
        except ImportError:
            pass
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            lib = None
        if lib is not None:
            import blutrain.tensor as bt

            lib.btc_omp_attach(*(ctypes.c_void_p(a) for a in bt._tensor._cpu_pool_entry_points()))
        _OMP.append(lib)
    return int(_OMP[0].btc_omp_max_threads()) if _OMP[0] is not None else 0


def desc_type(rank: int) -> type:
    """The ctypes struct of a ranked memref descriptor."""
    t = _DESC.get(rank)
    if t is None:
        fields = [
            ("allocated", ctypes.c_void_p),
            ("aligned", ctypes.c_void_p),
            ("offset", ctypes.c_longlong),
        ]
        if rank:
            fields += [("shape", ctypes.c_longlong * rank), ("strides", ctypes.c_longlong * rank)]
        t = type(f"MemRef{rank}D", (ctypes.Structure,), {"_fields_": fields})
        _DESC[rank] = t
    return t


def make_desc(ptr: int, shape: Sequence[int], strides: Sequence[int]) -> Any:
    d = desc_type(len(shape))()
    d.allocated = d.aligned = ptr
    d.offset = 0
    for i, (s, st) in enumerate(zip(shape, strides)):
        d.shape[i] = s
        d.strides[i] = st
    return d


class CpuKernel:
    """One compiled function: call(ptrs) with one data pointer per argument."""

    def __init__(
        self,
        fnptr: int,
        shapes: Sequence[Sequence[int]],
        strides: Sequence[Sequence[int]],
        keep: Any,
    ) -> None:
        self.keep = keep  # the engine or the library that owns the code
        self.descs = [make_desc(0, sh, st) for sh, st in zip(shapes, strides)]
        n = len(self.descs)
        proto = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p] * n))
        self.fn = proto(fnptr)
        self.args = [ctypes.addressof(d) for d in self.descs]

    def __call__(self, ptrs: Sequence[int]) -> None:
        for d, p in zip(self.descs, ptrs):
            if d.aligned != p:
                d.allocated = d.aligned = p
        self.fn(*self.args)


def jit(module: Any, opt_level: int | None = None) -> Any:
    """ExecutionEngine at LLVM -O1 by default (BLUTRAIN_COMPILE_OPT=0..3). GPT-2 tiny's whole
    training step (210 kernels): -O0 29 s to compile, 0.79x eager's step time; -O1 69 s,
    0.51x; -O2/-O3 longer still for no faster step (the kernels are memory-bound)."""
    from mlir.execution_engine import ExecutionEngine

    if opt_level is None:
        opt_level = int(os.environ.get("BLUTRAIN_COMPILE_OPT", "1"))
    omp_threads()  # parallel kernels call __kmpc_*: resolved in the process
    return ExecutionEngine(module, opt_level=opt_level)


def lookup(engine: Any, name: str) -> int:
    """The address of `_mlir_ciface_<name>` (the unpacked C interface)."""
    addr = engine.raw_lookup("_mlir_ciface_" + name)  # packed wrapper of the C interface
    if not addr:
        raise RuntimeError(f"[compile] JIT lost function {name}")
    return int(addr)


class PackedKernel(CpuKernel):
    """A kernel reached through ExecutionEngine's packed wrapper (void** of argument slots)."""

    def __init__(
        self,
        fnptr: int,
        shapes: Sequence[Sequence[int]],
        strides: Sequence[Sequence[int]],
        keep: Any,
    ) -> None:
        self.keep = keep
        self.descs = [make_desc(0, sh, st) for sh, st in zip(shapes, strides)]
        n = len(self.descs)
        self.slots = (ctypes.c_void_p * n)(*[ctypes.addressof(d) for d in self.descs])
        self.packed = (ctypes.c_void_p * n)(
            *[ctypes.addressof(self.slots) + i * ctypes.sizeof(ctypes.c_void_p) for i in range(n)]
        )
        self.fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(fnptr)
        self.arg = ctypes.addressof(self.packed)

    def __call__(self, ptrs: Sequence[int]) -> None:
        for d, p in zip(self.descs, ptrs):
            if d.aligned != p:
                d.allocated = d.aligned = p
        self.fn(self.arg)


def c_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def link_shared(obj: bytes, out_path: str) -> bool:
    """Links an object file into a shared library at out_path; False without a C compiler."""
    cc = c_compiler()
    if cc is None:
        return False
    with tempfile.TemporaryDirectory() as d:
        o = os.path.join(d, "k.o")
        with open(o, "wb") as f:
            f.write(obj)
        r = subprocess.run(
            [cc, "-shared", "-o", out_path, o, "-lm"], capture_output=True, text=True
        )
        if r.returncode != 0:
            raise RuntimeError(f"[compile] linking the kernel library failed: {r.stderr[-2000:]}")
    return True


def object_code(engine: Any) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.o")
        engine.dump_to_object_file(p)
        with open(p, "rb") as f:
            return f.read()


class SharedLib:
    """Compiled kernels loaded from a cached shared library (no compiler in this process)."""

    def __init__(self, path: str) -> None:
        omp_threads()
        self.lib = ctypes.CDLL(path)
        self.path = path

    def address(self, name: str) -> int:
        return ctypes.cast(getattr(self.lib, "_mlir_ciface_" + name), ctypes.c_void_p).value or 0
