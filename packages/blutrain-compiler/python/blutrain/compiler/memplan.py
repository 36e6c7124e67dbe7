"""The static memory plan: every intermediate buffer of a compiled program at a fixed offset of
one arena allocated once from blutrain.alloc.

Buffers are the values the steps write (fused kernels' outputs, GEMM outputs) that do not escape
the call (graph outputs, gradients handed to `.grad` and values copied into mutated inputs are
fresh tensors, since the caller keeps them) and that program.py does not write elsewhere
(optimizer updates into the tensors they update, values sharing another's buffer). A buffer
lives from the step that writes it to the last step that reads it (views included), or that
reads any value sharing it (`ends`). Offsets come from a greedy best fit over those
intervals, largest buffers first: two buffers share bytes only when their lifetimes do not
overlap; a step's outputs never alias its own inputs (a value read at step k is live at k).
The arena's size is the planned peak; with the arena in place a steady-state call makes no
allocator call for planned buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ALIGN = 256  # bytes: every buffer starts on a 256-byte boundary (vector loads, cuBLASLt)


@dataclass
class Buffer:
    value: int
    nbytes: int
    start: int  # step index that writes it
    end: int  # last step index that reads it
    offset: int = -1


@dataclass
class Plan:
    buffers: dict[int, Buffer] = field(default_factory=dict)
    size: int = 0  # arena bytes: the planned peak
    escaping: set[int] = field(default_factory=set)

    def describe(self) -> str:
        lines = [f"arena {self.size} bytes, {len(self.buffers)} buffers"]
        for b in sorted(self.buffers.values(), key=lambda b: b.offset):
            name = f"%{b.value}" if b.value >= 0 else f"tmp{-1 - b.value}"
            lines.append(f"  {name}: [{b.offset}, {b.offset + b.nbytes}) steps {b.start}-{b.end}")
        return "\n".join(lines) + "\n"


def _round(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def assign(bufs: list[Buffer]) -> int:
    """Offsets for buffers with lifetimes; returns the arena size."""
    placed: list[Buffer] = []
    size = 0
    for b in sorted(bufs, key=lambda b: (-b.nbytes, b.start, b.value)):
        live = sorted(
            (p for p in placed if not (p.end < b.start or b.end < p.start)), key=lambda p: p.offset
        )
        need = _round(max(b.nbytes, 1))
        best, best_gap = -1, None
        cur = 0
        for p in live:
            gap = p.offset - cur
            if gap >= need and (best_gap is None or gap < best_gap):
                best, best_gap = cur, gap
            cur = max(cur, p.offset + _round(max(p.nbytes, 1)))
        b.offset = best if best >= 0 else cur
        size = max(size, b.offset + need)
        placed.append(b)
    return size


def make(
    prog: Any,
    plannable: dict[int, int],
    escaping: set[int],
    ends: dict[int, int] | None = None,
    scratch: list[tuple[int, int, int]] | None = None,
) -> Plan:
    """plannable: value -> step index writing it (values whose memory the program chooses);
    ends: a later last step for buffers other values share (written in place over them);
    scratch: (key < 0, bytes, step) for a kernel's temporaries, live during their step only
    (Note [kernel temporaries in the arena] in program.py)."""
    g = prog.graph
    bufs = [Buffer(key, nbytes, k, k) for key, nbytes, k in scratch or ()]
    for v, k in plannable.items():
        if v in escaping:
            continue
        end = max(prog.last_use.get(v, k), (ends or {}).get(v, -1))
        bufs.append(Buffer(v, g.values[v].nbytes, k, max(end, k)))
    plan = Plan({b.value: b for b in bufs}, 0, set(escaping))
    plan.size = assign(bufs)
    return plan
