"""The ops the lowering takes, by kind (lower.py's Emitter has a method for each).

Kept apart from lower.py, which imports the MLIR bindings: fusion.partition reads these sets, and
a program loaded from the disk cache partitions its graph without MLIR (a GPU machine reading
cached PTX, Note [cache hits without MLIR] in cache.py)."""

from __future__ import annotations

UNARY = {
    "neg",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "tanh",
    "abs",
    "sigmoid",
    "relu",
    "sin",
    "cos",
    "gelu_tanh",
    "gelu",
    "erf",
    "logical_not",
    "sign",
}
BINARY = {
    "add",
    "sub",
    "mul",
    "div",
    "pow",
    "maximum",
    "minimum",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "logical_and",
    "logical_or",
    "and",
    "or",
}
VIEWS = {"reshape", "permute", "expand", "slice", "select", "squeeze", "unsqueeze"}
REDUCTIONS = {"sum", "mean", "max", "min", "amax", "amin", "var"}
COMPOSITES = {
    "softmax",
    "log_softmax",
    "softmax_backward",
    "log_softmax_backward",
    "layer_norm",
    "layer_norm_backward",
    "cross_entropy",
    "cross_entropy_backward",
    "add_layer_norm",
}
OTHER = {
    "adamw_scalars",
    "adamw_update",
    "sumsq",
    "sqrt_sum",
    "full",
    "arange",
    "astype",
    "where",
    "masked_fill",
    "copy_",
    "contiguous",
    "clone",
    "cat",
    "accumulate_grad",
    "adamw_",
    "grad_norm",
    "clip_coef",
    "scale_",
}
LOWERABLE = UNARY | BINARY | VIEWS | REDUCTIONS | COMPOSITES | OTHER
# lowered for CPU targets only (fusion.partition(cpu=True)); eager steps on the GPU
CPU_LOWERABLE = {"slice_scatter"}
