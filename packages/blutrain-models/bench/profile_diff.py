"""Where one arm's step spends more GPU time than another's, kernel by kernel.

Reads bench_gpt2.py worker results with a profile (`--profile N`, any N > 0, puts every
kernel's GPU ms a step in the RESULT line; `bench/ab_step.sh` keeps each arm's as
$OUT/ab_MODE_LABEL_rR.json) and prints, per kernel, B's ms a step, A's, and the difference,
largest first; kernels are grouped by their name without template arguments (an op's float32
and bf16 instances pair up), or by their full name with --full. Several files per arm are
averaged (rounds of ab_step.sh). Issue 38: which kernels carry the float32 residual stream's
extra milliseconds, against what its extra bytes (`bench/op_trace.py`) would cost at the card's
bandwidth.

    bash bench/ab_step.sh bf16 ours+graph 10 2 "f32s||--profile 1" \\
        "bf16s||--profile 1 --residual-dtype compute"
    python3 bench/profile_diff.py out/ab_bf16_bf16s_r*.json -- out/ab_bf16_f32s_r*.json

Not a test: it prints a table (and --json writes it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_gaps import short  # noqa: E402


def load_arm(paths: list[str], full: bool) -> tuple[dict[str, float], dict[str, float], dict]:
    """Mean ms a step and launches a step per kernel group over an arm's result files, and the
    mean of the files' step figures (step_ms, tokens_per_s, GPU busy)."""
    if not paths:
        raise SystemExit("profile_diff: an arm has no result files")
    ms: dict[str, float] = {}
    cnt: dict[str, float] = {}
    steps = {"step_ms": 0.0, "tokens_per_s": 0.0, "busy_ms": 0.0}
    for p in paths:
        try:
            r = json.loads(Path(p).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"profile_diff: cannot read {p}: {e}") from None
        if not r.get("kernels"):
            raise SystemExit(
                f"profile_diff: {p} has no kernel profile (run the arm with --profile N; "
                f"its error: {r.get('error', 'none')})"
            )
        for name, t, c in r["kernels"]:
            key = name if full else short(name, 60)
            ms[key] = ms.get(key, 0.0) + t / len(paths)
            cnt[key] = cnt.get(key, 0.0) + c / len(paths)
        steps["step_ms"] += r.get("step_ms", 0.0) / len(paths)
        steps["tokens_per_s"] += r.get("tokens_per_s", 0.0) / len(paths)
        steps["busy_ms"] += sum(k[1] for k in r["kernels"]) / len(paths)
    return ms, cnt, steps


def diff(a: dict[str, float], b: dict[str, float], ca: dict, cb: dict) -> list[dict]:
    """One row per kernel group in either arm, largest |B - A| first."""
    rows = [
        {
            "kernel": k,
            "a_ms": round(a.get(k, 0.0), 4),
            "b_ms": round(b.get(k, 0.0), 4),
            "delta_ms": round(b.get(k, 0.0) - a.get(k, 0.0), 4),
            "a_per_step": round(ca.get(k, 0.0), 2),
            "b_per_step": round(cb.get(k, 0.0), 2),
        }
        for k in set(a) | set(b)
    ]
    return sorted(rows, key=lambda r: (-abs(r["delta_ms"]), r["kernel"]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print(
            "usage: profile_diff.py [options] A.json [A2.json ...] -- B.json [...]", file=sys.stderr
        )
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", nargs="+", help="arm A's worker results (the baseline)")
    p.add_argument("--top", type=int, default=20, help="rows to print")
    p.add_argument("--full", action="store_true", help="group by full kernel names")
    p.add_argument("--json", default=None, help="write the rows here")
    opts = p.parse_args(argv[:cut])
    b_paths = argv[cut + 1 :]
    a_ms, a_cnt, a_step = load_arm(opts.a, opts.full)
    b_ms, b_cnt, b_step = load_arm(b_paths, opts.full)
    rows = diff(a_ms, b_ms, a_cnt, b_cnt)
    if opts.json:  # before the table: a reader that stops early (| head) keeps the file
        out = {"a": opts.a, "b": b_paths, "a_step": a_step, "b_step": b_step, "rows": rows}
        tmp = Path(f"{opts.json}.tmp")
        tmp.write_text(json.dumps(out, indent=2))
        tmp.replace(opts.json)
    print(
        f"A ({len(opts.a)} file(s)): {a_step['tokens_per_s']:,.0f} tok/s, step "
        f"{a_step['step_ms']:.2f} ms, GPU busy {a_step['busy_ms']:.3f} ms a step"
    )
    print(
        f"B ({len(b_paths)} file(s)): {b_step['tokens_per_s']:,.0f} tok/s, step "
        f"{b_step['step_ms']:.2f} ms, GPU busy {b_step['busy_ms']:.3f} ms a step"
    )
    d_busy = b_step["busy_ms"] - a_step["busy_ms"]
    print(f"B - A: step {b_step['step_ms'] - a_step['step_ms']:+.3f} ms, GPU busy {d_busy:+.3f} ms")
    print(f"{'B - A ms':>9s} {'A ms':>8s} {'B ms':>8s} {'A n':>6s} {'B n':>6s}  kernel")
    for r in rows[: opts.top]:
        print(
            f"{r['delta_ms']:+9.3f} {r['a_ms']:8.3f} {r['b_ms']:8.3f} {r['a_per_step']:6.1f} "
            f"{r['b_per_step']:6.1f}  {r['kernel']}"
        )
    rest = sum(r["delta_ms"] for r in rows[opts.top :])
    if len(rows) > opts.top:
        print(f"{rest:+9.3f} in the other {len(rows) - opts.top} kernel groups")
    return 0


if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # the reader (| head) closed the pipe: the table was cut, no error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    raise SystemExit(code)
