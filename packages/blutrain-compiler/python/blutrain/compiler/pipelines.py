"""The pass pipelines, by stage name (what BLUTRAIN_COMPILE_DUMP writes after each)."""

from __future__ import annotations

# No cse here: it would merge the identical linalg.fill inits of two reductions into one tensor,
# which bufferization then copies (a host-side memref.copy on the GPU path).
FUSE = "builtin.module(linalg-fuse-elementwise-ops, canonicalize)"

BUFFERIZE = (
    "builtin.module(one-shot-bufferize{bufferize-function-boundaries "
    "function-boundary-type-conversion=identity-layout-map}, "
    "buffer-results-to-out-params{hoist-static-allocs=true modify-public-functions=true}, "
    "canonicalize, cse)"
)

# Small temporaries (a row's statistics) on the stack: no malloc in a kernel call.
# Larger temporaries (a full-size value read by a gather) are freed by the deallocation pipeline.
CPU_LOOPS = (
    "builtin.module(func.func(promote-buffers-to-stack{max-alloc-size-in-bytes=65536}), "
    "buffer-deallocation-pipeline, convert-linalg-to-loops, canonicalize)"
)

CPU_LLVM = (
    "builtin.module(expand-strided-metadata, lower-affine, convert-scf-to-cf, "
    "convert-math-to-llvm, convert-math-to-libm, convert-to-llvm, reconcile-unrealized-casts)"
)
