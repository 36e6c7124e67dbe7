"""Idle time between the GPU's kernels in a torch.profiler chrome trace (bench_gpt2.py --trace).

Prints the trace's span, the union of kernel / memset / memcpy intervals, and the idle gaps
summed by the kind of the event before and after each gap, largest first: where a step waits on
launches rather than on work. With --seq, also every event in order (name, duration, gap before).

    python3 bench_gpt2.py --worker ours+graph --mode bf16 --profile 1 --trace /tmp/t.json
    python3 trace_gaps.py /tmp/t.json --steps 2
"""

from __future__ import annotations

import argparse
import json
import re
import sys

KINDS = ("kernel", "gpu_memset", "gpu_memcpy")


def short(name: str, chars: int = 48) -> str:
    """A kernel's name without its namespaces, template arguments and parameters."""
    n = re.sub(r"\(.*$", "", name.replace("(anonymous namespace)", ""))
    depth, out = 0, []
    for ch in n:  # drop <...> (nested)
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    n = "".join(out).replace("void ", "")
    n = n.split("::")[-1] if "nvjet" not in n else n
    return n[:chars]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=1, help="steps in the trace (per-step figures)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--seq", action="store_true", help="print every event in order")
    a = p.parse_args()
    with open(a.trace) as f:
        ev = [
            e for e in json.load(f).get("traceEvents", []) if e.get("cat") in KINDS and "dur" in e
        ]
    if not ev:
        print("no GPU events in the trace", file=sys.stderr)
        return 1
    ev.sort(key=lambda e: float(e["ts"]))
    span = float(ev[-1]["ts"]) + float(ev[-1]["dur"]) - float(ev[0]["ts"])
    busy, gaps, end = 0.0, {}, float(ev[0]["ts"])
    prev = None
    rows = []
    for e in ev:
        t0, d = float(e["ts"]), float(e["dur"])
        name = "memset" if e["cat"] == "gpu_memset" else short(e["name"])
        gap = max(0.0, t0 - end)
        if prev is not None and gap > 0:
            key = f"{prev} -> {name}"
            g, c = gaps.get(key, (0.0, 0))
            gaps[key] = (g + gap, c + 1)
        busy += max(0.0, t0 + d - max(t0, end))
        end = max(end, t0 + d)
        rows.append((name, d, gap, e.get("args", {}).get("grid")))
        prev = name
    n = a.steps
    print(
        f"{len(ev) / n:.0f} events a step; span {span / 1e3 / n:.3f} ms, busy {busy / 1e3 / n:.3f}"
        f" ms, idle {(span - busy) / 1e3 / n:.3f} ms a step"
    )
    print(f"idle gaps by neighbours (us a step, count a step), top {a.top}:")
    for k, (g, c) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[: a.top]:
        print(f"  {g / n:9.1f}  {c / n:6.1f}x  {k}")
    if a.seq:
        for name, d, gap, grid in rows:
            print(f"{gap:7.1f} {d:8.1f}  {name}  {grid}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
