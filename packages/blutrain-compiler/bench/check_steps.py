"""Where does a compiled training step leave eager's numbers?  Runs the test suite's compiled
steps (tests/compiler_cases.py: the LLaMA-style tiny step in fp32 / bf16, the small GPT-2 bf16
step) with Program.run replaced by a checking copy: after every step of the program (a fused
kernel, a GEMM or gather written into the arena, an eager node) its outputs are compared with
the same nodes replayed through blutrain.tensor's eager kernels on the same inputs, and the
first differing steps are printed with their ops.  Ops with no eager replay (AdamW's fused
update, sums of squares) are checked for NaN out of NaN-free inputs instead.

Written for the H100 run of session 45, where every fused kernel matched eager alone but the
compiled LLaMA step gave a NaN loss from step 0 and GPT-2's from step 1 (CPU: same bits).

    python bench/check_steps.py --device cuda llama32:check gpt2bf16:check
    python bench/check_steps.py --device cuda --quick llama32 llama32:nogather llama32:noplans

A spec is MODEL[:VARIANT]; MODEL: llama32, llama16, gpt2bf16; VARIANT: check (the per-step
comparison), nogather (embedding gathers run eagerly), noplans (every GEMM through
blutrain.linalg's general path, no reused plan), zero / ff (the arena filled with 0x00 / 0xFF
bytes before the first call: a step that reads memory no step wrote changes with it), or none
(the plain compiled step).  --quick first checks the pieces a compiled CUDA step leans on:
blutrain.linalg GEMMs into given memory on the current stream, and AdamW's device scalars
written by fill_.

Session 46 found with it that rowgen dropped the stores of a rotary group's permuted copy
(its halves are read through subviews: Note [views of register values] in rowgen.py) and
that bf16 constants reached kernels as -1 (Note [16-bit kernel scalars] in backend_gpu.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

import blutrain.tensor as bt
from blutrain.compiler import eager, fusion
from blutrain.compiler import program as P

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

FLOATS = (bt.float32, bt.bfloat16, bt.float16, bt.float64)
TOL = {bt.bfloat16: 3e-2, bt.float16: 3e-2}  # else 2e-3 of the output's largest |value|


class Report:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bad: list[str] = []
        self.unchecked: set[str] = set()
        self.groups = 0

    def add(self, msg: str) -> None:
        if len(self.bad) < self.limit:
            self.bad.append(msg)
            print("BAD", msg, flush=True)


REPORT = Report(12)
CORRUPT: set[int] = set()  # program steps whose first output is doubled (the checker's own test)
_orig = {
    "run": P.Program.run,
    "gather_ok": P._gather_out_ok,
    "arena_views": P.Program._arena_views,
    "gemm_into": P._gemm_into,
}


def _np(t: Any) -> np.ndarray:
    return t.detach().to(bt.float64).cpu().numpy()


def _has_nan(t: Any) -> bool:
    return t.dtype in FLOATS and bool(np.isnan(_np(t)).any())


def compare(tag: str, got: Any, want: Any) -> str | None:
    """None when got matches want (same NaN / inf counts, max error <= TOL of max |want|)."""
    g, w = _np(got), _np(want)
    if g.shape != w.shape:
        return f"{tag}: shape {g.shape} vs {w.shape}"
    fin = np.isfinite(g) & np.isfinite(w)
    scale = np.abs(w[fin]).max(initial=0) or 1.0
    err = np.abs(g[fin] - w[fin]).max(initial=0) / scale
    counts = [int(np.isnan(g).sum()), int(np.isnan(w).sum())]
    counts += [int(np.isinf(g).sum()), int(np.isinf(w).sum())]
    if counts[0] != counts[1] or counts[2] != counts[3] or err > TOL.get(got.dtype, 2e-3):
        return (
            f"{tag}: rel err {err:.3g}, NaN {counts[0]} (eager {counts[1]}), inf {counts[2]} "
            f"(eager {counts[3]}), {got.dtype} {g.shape}"
        )
    return None


def replay_group(prog: P.Program, st: fusion.Group, env: dict[int, Any]) -> dict[int, Any]:
    """The values of a fused group's nodes through blutrain.tensor's eager kernels, on the
    inputs in env; raises NotImplementedError for an op with no eager replay."""
    ref: dict[int, Any] = {}
    for n in st.nodes:
        args = [ref[i] if i in ref else (prog.value(env, i) if i >= 0 else None) for i in n.inputs]
        ref.update(zip(n.outputs, eager.run(n, args, prog.graph.raw)))
    return ref


def checking_run(self: P.Program, inputs: list[Any]) -> dict[int, Any]:
    """Program.run, step for step, with each step checked against an eager replay."""
    g = self.graph
    sync = bt.cuda.synchronize if self.target.startswith("cuda") else (lambda: None)
    self.ready()
    env: dict[int, Any] = dict(zip(g.inputs, inputs))
    for k, st in enumerate(self.part.steps):
        if isinstance(st, fusion.Group):
            ins = [self.value(env, i) for i in st.inputs]
            ins = [t if t.is_contiguous() else t.contiguous() for t in ins]
            ref: dict[int, Any] | None
            try:  # before the kernel, which may write its inputs' memory (in-place updates)
                ref = replay_group(self, st, env)
            except NotImplementedError as e:  # (no eager replay: NaN check only)
                ref = None
                REPORT.unchecked.add(str(e).rsplit(" ", 1)[-1])
            REPORT.groups += 1
            outs = [self._out(o, env) for o in st.outputs]
            self.kernels[st.id]([t.data_ptr() for t in ins] + [t.data_ptr() for t in outs])
            if k in CORRUPT:
                with bt.no_grad():
                    outs[0].mul_(2)
            sync()
            in_nan = any(_has_nan(t) for t in ins)
            ops = " ".join(n.op for n in st.nodes)[:300]
            for o, t in zip(st.outputs, outs):
                env[o] = t
                if ref is not None and o in ref:
                    msg = compare(f"%{o}", t, ref[o])
                elif ref is None and not in_nan and _has_nan(t):
                    msg = f"%{o}: NaN out of NaN-free inputs"
                else:
                    msg = None
                if msg:
                    REPORT.add(f"step {k} group {st.id} ({ops}): {msg}")
        else:
            n = st.node
            args = [self.value(env, i) if i >= 0 else None for i in n.inputs]
            o = n.outputs[0] if n.outputs else -1
            into = self.eager_step(k, n, args, env)
            sync()
            if into in ("gemm", "gather"):
                msg = compare(f"%{o}", env[o], eager.run(n, args, g.raw)[0])
                if msg:
                    REPORT.add(f"step {k} {into} {n.op}: {msg}")
            elif not any(_has_nan(a) for a in args if a is not None and hasattr(a, "dtype")):
                for oo in n.outputs:
                    t = env.get(oo)
                    if t is not None and hasattr(t, "dtype") and _has_nan(t):
                        REPORT.add(f"step {k} eager {n.op}: %{oo} NaN out of NaN-free inputs")
        self.end_step(k, env)
    return env


def _filled_arena(byte: int) -> Any:
    def views(self: P.Program) -> None:
        _orig["arena_views"](self)
        self.arena.fill_(byte)

    return views


def run_spec(spec: str, device: str) -> dict[str, Any]:
    """One model's eager and compiled steps under one variant; returns the runs and the report."""
    import compiler_cases as CC

    model, _, variant = spec.partition(":")
    P._gather_out_ok = (lambda g, n: False) if variant == "nogather" else _orig["gather_ok"]
    P.Program._arena_views = (
        _filled_arena(0 if variant == "zero" else 255)
        if variant in ("zero", "ff")
        else _orig["arena_views"]
    )
    P.Program.run = checking_run if variant == "check" else _orig["run"]
    if variant == "noplans":  # every GEMM through linalg's general path (Note [GEMM plans])
        P._gemm_into = lambda n, x, out, plans=None: _orig["gemm_into"](n, x, out, None)
    REPORT.__init__(REPORT.limit)
    try:
        if model == "llama32":
            runs = CC.llama_steps(bt.float32, device)
        elif model == "llama16":
            runs = CC.llama_steps(bt.bfloat16, device)
        elif model == "gpt2bf16":
            runs = CC.gpt2_bf16_steps("float32", device)
        else:
            raise SystemExit(f"[check_steps] unknown model {model!r} (llama32, llama16, gpt2bf16)")
    finally:
        P._gather_out_ok = _orig["gather_ok"]
        P.Program._arena_views = _orig["arena_views"]
        P.Program.run = _orig["run"]
        P._gemm_into = _orig["gemm_into"]
    return {"runs": runs, "bad": list(REPORT.bad), "groups": REPORT.groups}


def quick(device: str) -> None:
    import blutrain.linalg as L
    from blutrain.models.optim import AdamW

    rng = np.random.default_rng(0)
    for dt, mode in ((bt.float32, "fp32"), (bt.float32, "tf32"), (bt.bfloat16, None)):
        a = bt.tensor(rng.standard_normal((256, 64)), dtype=dt).to(device)
        w = bt.tensor(rng.standard_normal((192, 64)), dtype=dt).to(device)
        b = bt.tensor(rng.standard_normal(192), dtype=dt).to(device)
        out = bt.empty((256, 192), dtype=dt, device=device)
        st = int(bt._tensor._cuda_current_stream(0)) if device.startswith("cuda") else None
        L.matmul(a, w, transb=True, bias=b, out=out, mode=mode, stream=st)
        print(f"linalg GEMM out= {dt} {mode}:", compare("out", out, bt.linear(a, w, b)) or "ok")
    p = bt.zeros(4, device=device).requires_grad_(True)
    opt = AdamW([("p", p)], lr=1e-3)
    opt.use_device_scalars()
    opt.write_device_scalars(3e-4, 2)
    got = [(float(lr.item()), float(s.item())) for lr, s in opt._dev_scalars.values()]
    print("AdamW device scalars after write_device_scalars(3e-4, 2):", got)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="*", default=["llama32:check"])
    ap.add_argument("--device", default="cuda" if bt.cuda_device_count() else "cpu")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    if a.quick:
        quick(a.device)
    worst = 0
    for spec in a.specs:
        t0 = time.perf_counter()
        r = run_spec(spec, a.device)
        (le, _), (lc, _) = r["runs"]["eager"], r["runs"]["compiled"]
        print(
            f"== {spec} on {a.device} ({time.perf_counter() - t0:.0f} s): losses eager "
            f"{[round(x, 6) for x in le]}, compiled {[round(x, 6) for x in lc]}; "
            f"{len(r['bad'])} bad steps of {r['groups']} groups checked",
            flush=True,
        )
        worst = max(worst, len(r["bad"]))
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main())
