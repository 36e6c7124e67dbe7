"""blutrain.compiler: captured blutrain.tensor programs compiled through upstream MLIR.

    import blutrain.compiler as btc
    step = btc.compile(train_step)   # guards, runtime scalars, fused kernels, a disk cache

See the package README for the pipeline, the dump, the cache and the memory plan.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .api import CompiledFunction, RecompileLimitError, compile
from .graph import Graph, from_capture
from .program import CompileError, build

__all__ = [
    "CompileError",
    "CompiledFunction",
    "Graph",
    "RecompileLimitError",
    "build",
    "compile",
    "from_capture",
]
