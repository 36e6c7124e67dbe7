"""Recompute instead of materialise: elementwise producers with several consumers are cloned,
one copy per consumer, before upstream fusion.

linalg-fuse-elementwise-ops fuses a producer only into its single consumer: a softmax's
`x * 2 + 1` read by the max, the sum and the normalisation would stay a full-size tensor
written to memory and read three times. Cloning it per use (cheap arithmetic, memory-bound
kernels) lets each copy fuse into its consumer, so the value never exists in memory. A use by
the function's return keeps the original.
"""

from __future__ import annotations

from typing import Any

MAX_BODY_OPS = 96  # a producer's body larger than this is materialised rather than recomputed
MAX_USES = 8


def _all_parallel(op: Any) -> bool:
    a = op.attributes["iterator_types"]
    return all("parallel" in str(a[i]) for i in range(len(a)))


def duplicate(module: Any) -> int:
    """Clones multi-use elementwise linalg.generic ops per use; returns how many clones."""
    from mlir import ir
    from mlir.dialects import func

    n = 0
    for fop in module.body.operations:
        if not isinstance(fop.opview, func.FuncOp):
            continue
        ops = [
            o for o in fop.regions[0].blocks[0].operations if o.operation.name == "linalg.generic"
        ]
        for o in reversed(ops):
            op = o.operation
            if len(op.results) != 1 or not _all_parallel(op):
                continue
            body = op.regions[0].blocks[0]
            if len(list(body.operations)) > MAX_BODY_OPS:
                continue
            uses = [(u.owner, u.operand_number) for u in op.results[0].uses]
            if len(uses) < 2 or len(uses) > MAX_USES:
                continue
            keep = next((i for i, (ow, _) in enumerate(uses) if ow.name == "func.return"), 0)
            for i, (owner, k) in enumerate(uses):
                if i == keep:
                    continue
                c = op.clone(ip=ir.InsertionPoint(op))  # before op: its operands exist there
                owner.operands[k] = c.results[0]
                n += 1
    return n
