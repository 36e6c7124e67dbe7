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

# The CPU's: first empty-tensor elimination, so a value inserted into a larger one (slice_scatter,
# Note [slice_scatter in the kernel] in lower.py) is computed in place in its slice; the second
# canonicalize drops the self-copy of that slice bufferization leaves once cse merged the two
# subviews. The GPU keeps BUFFERIZE (its row kernels take no insert_slice).
BUFFERIZE_CPU = (
    "builtin.module(eliminate-empty-tensors, one-shot-bufferize{bufferize-function-boundaries "
    "function-boundary-type-conversion=identity-layout-map}, "
    "buffer-results-to-out-params{hoist-static-allocs=true modify-public-functions=true}, "
    "canonicalize, cse, canonicalize)"
)

# Small temporaries (a row's statistics) on the stack: no malloc in a kernel call.
# Larger temporaries (a full-size value read by a gather) are freed by the deallocation pipeline.
CPU_PREP = (
    "builtin.module(func.func(promote-buffers-to-stack{max-alloc-size-in-bytes=65536}), "
    "buffer-deallocation-pipeline)"
)

# Note [parallel CPU loops]: a kernel that touches at least PARALLEL_MIN elements runs its
# outermost parallel loops on several threads: its linalg ops become affine loops, upstream's
# affine-parallelize (dependence analysis) turns the outermost parallel loop of each nest into a
# parallel loop (reductions stay serial, so every sum adds in the serial order), and
# convert-scf-to-openmp makes it an omp.parallel worksharing loop, statically scheduled in
# contiguous blocks (the runtime: src/kmp_pool.c on blutrain.tensor's pool and budget). Smaller
# kernels stay serial loops: a fork costs more than they do. Both are per function (one group).
# Then (serial kernels too) affine-super-vectorize turns each innermost loop over a contiguous dim
# into 8-wide vector
# ops (loads, the arith / exp polynomial, stores): elementwise loops and the lanes loop of a
# row reduction (Note [row reductions in lanes] in lower.py); loops that carry a sum stay scalar
# (it vectorises parallel loops only), so every sum keeps its order. Single-iteration loops are
# removed first (its dependence test calls them parallel, then fails on their invariant store).
# affine-loop-invariant-code-motion moves a row's own values (the loads of its statistics and
# what is computed from them alone, a cross-entropy backward's log of the exp sum) out of the
# loop over its columns: the vectorised loops would otherwise redo them every 8 elements.
# Moving code changes no arithmetic.
PARALLEL_MIN = 32768  # elements; blutrain.tensor's eager kernels go parallel at the same size
#
# Note [slices read through their base]: between the two, program._fold_unit_subviews makes
# the loops read a slice that starts at 0 with unit strides (GPT-2's logits: the first 50257 of
# 50304 padded columns) from its base buffer at the same indices. The slice's strided layout
# is what affine-super-vectorize refuses ('NYI: non-trivial layout map'): the loss kernels over
# those logits (max, exp sum, gradient) ran scalar, 4x slower than eager's. Same addresses,
# same arithmetic; a vector read past the slice's last column stays inside the base's row or
# is masked by the base's bounds, and its lanes are never stored.
CPU_TO_LOOPS = "builtin.module(func.func(convert-linalg-to-affine-loops))"
CPU_SERIAL = (
    "func.func(affine-loop-normalize{promote-single-iter=true}, "
    "affine-loop-invariant-code-motion, "
    "affine-super-vectorize{virtual-vector-size=8 test-fastest-varying=0}, lower-affine)"
)
CPU_PARALLEL = (
    "func.func(affine-parallelize{max-nested=1}, "
    "affine-loop-normalize{promote-single-iter=true}, "
    "affine-loop-invariant-code-motion, "
    "affine-super-vectorize{virtual-vector-size=8 test-fastest-varying=0}, lower-affine)"
)
CPU_OMP = "builtin.module(convert-scf-to-openmp, canonicalize)"
# for the cache key (the subview fold between CPU_TO_LOOPS and the rest is named in it)
CPU_LOOPS = " ; ".join(
    (
        BUFFERIZE_CPU,
        CPU_PREP,
        CPU_TO_LOOPS,
        "fold-unit-subviews",
        "fold-view-chain-loads",
        "fuse-row-loops",
        CPU_SERIAL,
        CPU_PARALLEL,
        "serialize-small-nests",
        CPU_OMP,
        "nowait-sole-loops",
    )
)

CPU_LLVM = (
    "builtin.module(func.func(convert-vector-to-scf, lower-vector-mask), expand-strided-metadata, "
    "lower-affine, convert-scf-to-cf, convert-vector-to-llvm, "
    "convert-math-to-llvm, convert-math-to-libm, convert-to-llvm, reconcile-unrealized-casts)"
)
