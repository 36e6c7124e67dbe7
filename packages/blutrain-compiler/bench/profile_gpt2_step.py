"""Where a compiled GPT-2 (or LLaMA-style) step's time goes on the CPU or a GPU, next to the same
nodes run eagerly.

    python profile_gpt2_step.py [--model tiny|gpt2|llama-tiny|llama-small] [-B 2] [-T 64]
                                [--steps 5] [--mode tf32|fp32] [--threads N] [--top N]
                                [--no-eager-nodes] [--device cpu|cuda]

On CUDA (`--device cuda`) every timed piece is bracketed by device synchronisations, so a
category's figure is its kernels' time plus one launch each, and `glue` is the host time
between them; the `step` line (no synchronisation inside a call) shows how much of the
synchronised sum the GPU overlaps with the host.

The step of bench_gpt2_compiled.py (forward, loss, backward, clipping, AdamW), or with
`--model llama-tiny` bench_compiler.py's LLaMA-style step (llama_ref.py, B=4 T=64 by default:
forward, backward, AdamW written in ops), compiled with blutrain.compiler; each program step
is timed (wall clock, perf_counter) by wrapping the
program's kernels and the library / eager calls from outside (nothing in program.py changes):
  fused      the compiled kernels (one per fusion group), by the kind of nodes they hold
  gemm       blutrain.linalg GEMMs (linear / matmul written into planned buffers)
  attention  blutrain.tensor's attention kernels (library steps through replay)
  eager      gathers, scatters, other eager steps
  glue       Program.run around them (argument lists, views, freeing) and the call's guards,
             binding and gradient hand-off: the whole call minus the parts above
The second table times the same captured graph (before decompose.py) with every node run by
blutrain.tensor's eager kernels one at a time (the compiler's all-fallback partition, on copies
of the inputs), so each category compares the same work (it adds a replay's Python per node);
`--top N` lists the N slowest fused kernels and GEMMs (compiled next to eager). The `step` line
times the real eager step (autograd) and the compiled call end to end, interleaved step by step
so that the machine's load hits both alike. At one thread (`--threads 1`) the figures hold
steady on a shared machine; a pool of several threads stalls whenever one is descheduled.
Not a test: prints medians in ms per step. Dev tool for issue 34's CPU gap.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from bench_gpt2_compiled import MODELS, build_step  # this folder: the script's sys.path[0]


def build(a):
    """(eager step, compiled step, call, args): call(fn) runs one step of fn (either) on the
    fixed batch, args() the compiled step's arguments for its last call. GPT-2: the step of
    bench_gpt2_compiled.py on the CPU in its precision (--mode, default tf32); llama-tiny:
    the step of bench_compiler.py's worker (lr and the step count t runtime scalars)."""
    import blutrain.compiler as btc
    import blutrain.tensor as bt

    k = 0
    dev = a.device
    if not a.model.startswith("llama"):
        step, opt, x, y = build_step(a.model, a.B, a.T, dev, a.mode)

        def call(fn):
            nonlocal k
            k += 1
            opt.write_device_scalars(3e-4, k)
            return fn(x, y)

        return step, btc.compile(step), call, lambda: (x, y)
    import llama_ref as L
    import numpy as np

    cfg = L.Config.preset(a.model.split("-")[1])
    cfg.seq = a.T
    params = {n: bt.tensor(v).to(dev).requires_grad_(True) for n, v in L.init_weights(cfg).items()}
    state = {
        n: (bt.zeros(p.shape, device=dev), bt.zeros(p.shape, device=dev)) for n, p in params.items()
    }
    cos, sin = (bt.tensor(t).to(dev) for t in L.rope_tables(cfg))
    rng = np.random.default_rng(1)
    x, y = (bt.tensor(rng.integers(0, cfg.vocab, (a.B, cfg.seq))).to(dev) for _ in range(2))

    step = L.bt_step(bt, cfg, params, state, cos, sin)
    cstep = btc.compile(step, scalars=("t",))

    def call(fn):
        nonlocal k
        k += 1
        if fn is cstep:
            return fn(x, y, 1e-3, k)
        return fn(x, y, bt.full((), 1e-3, device=dev), bt.full((), float(k), device=dev))

    return step, cstep, call, lambda: (x, y, 1e-3, k)


def kind_of_group(G) -> str:
    ops = {n.op for n in G.compute_nodes()}
    for key, names in (
        ("adamw", {"adamw_update", "adamw_scalars"}),
        ("loss", {"cross_entropy", "cross_entropy_backward"}),
        ("layer_norm", {"layer_norm", "add_layer_norm", "layer_norm_backward"}),
        ("softmax", {"softmax", "softmax_backward", "log_softmax"}),
        ("grad_norm", {"grad_norm", "sumsq", "clip_coef"}),
    ):
        if ops & names:
            return "fused:" + key
    return "fused:other"


def kind_of_step(st) -> str:
    n = st.node
    if n.op in ("linear", "matmul", "bmm"):
        return "gemm"
    if "attention" in n.op:
        return "attention"
    if st.kind == "library":
        return "library:" + n.op
    return "eager:" + n.op


PER_KERNEL: dict[int, float] = defaultdict(float)
PER_NODE: dict[int, float] = defaultdict(float)  # GEMM node -> seconds (compiled)
PER_NODE_EAGER: dict[int, float] = defaultdict(float)


SYNC = [lambda: None]  # the device synchronisation around timed pieces (CUDA)


def instrument(prog, times):
    """Wraps the kernels and the eager / library entry points program.py calls; returns a
    function that puts the entry points back (the eager replay then times only itself)."""
    from blutrain.compiler import eager
    from blutrain.compiler import program as P

    sync = SYNC[0]

    by_id = {G.id: G for G in prog.part.groups}
    for gid, k in list(prog.kernels.items()):
        cat = kind_of_group(by_id[gid])

        def timed(ptrs, _k=k, _cat=cat, _g=gid):
            sync()
            t0 = time.perf_counter()
            _k(ptrs)
            sync()
            dt = time.perf_counter() - t0
            times[_cat] += dt
            PER_KERNEL[_g] += dt

        timed.fn = getattr(k, "fn", None)  # (the plan reads a GPU kernel's temporaries)
        prog.kernels[gid] = timed
    step_of = {
        st.node.index: kind_of_step(st) for st in prog.part.steps if not hasattr(st, "outputs")
    }

    def wrap(mod, name, node_arg=0):
        f = getattr(mod, name)

        def timed(*args, **kw):
            n = args[node_arg]
            sync()
            t0 = time.perf_counter()
            r = f(*args, **kw)
            sync()
            dt = time.perf_counter() - t0
            cat = step_of.get(n.index, "view" if n.op in eager.VIEW_OPS else "eager:" + n.op)
            times[cat] += dt
            if cat == "gemm":
                PER_NODE[n.index] += dt
            return r

        setattr(mod, name, timed)

    saved = [(m, n, getattr(m, n)) for m, n in ((P, "_gemm_into"), (P, "_gather_into"))]
    saved += [(eager, n, getattr(eager, n)) for n in ("run", "run_over_base")]
    for m, n, _ in saved:
        wrap(m, n)

    def undo() -> None:
        for m, n, f in saved:
            setattr(m, n, f)

    return undo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--model", default="tiny", choices=sorted(MODELS) + ["llama-tiny", "llama-small"]
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("-B", type=int, default=0, help="2 (GPT-2), 4 (llama-tiny)")
    ap.add_argument("-T", type=int, default=64)
    ap.add_argument("--mode", default="tf32", choices=("fp32", "tf32"), help="GPT-2's precision")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--top", type=int, default=8, help="the N slowest fused kernels")
    ap.add_argument("--no-eager-nodes", action="store_true")
    a = ap.parse_args()
    a.B = a.B or {"llama-tiny": 4, "llama-small": 8}.get(a.model, 2)
    import blutrain.tensor as bt

    if a.device.startswith("cuda"):
        SYNC[0] = bt.cuda.synchronize
        a.no_eager_nodes = True  # (the node-by-node replay below is the CPU's)
    from blutrain.compiler import fusion
    from blutrain.compiler import program as P

    if a.threads:
        bt.set_num_threads(a.threads)
    step, cstep, call, cargs = build(a)
    call(step)  # eager: moments exist
    call(cstep)
    call(cstep)
    (c,) = cstep.programs.values()
    prog = c.prog
    eager_ms, comp_ms = [], []
    for _ in range(a.steps):  # interleaved: the machine's load hits both alike
        for fn, acc in ((step, eager_ms), (cstep, comp_ms)):
            SYNC[0]()
            t0 = time.perf_counter()
            call(fn)
            SYNC[0]()
            acc.append(1e3 * (time.perf_counter() - t0))
    # per category
    per: list[dict] = []
    times: dict[str, float] = defaultdict(float)
    uninstrument = instrument(prog, times)
    for _ in range(a.steps):
        times.clear()
        SYNC[0]()
        t0 = time.perf_counter()
        call(cstep)
        SYNC[0]()
        tot = time.perf_counter() - t0
        times["glue"] = tot - sum(times.values())
        per.append({kk: 1e3 * v for kk, v in times.items()})
    rows = {kk: statistics.median(p.get(kk, 0.0) for p in per) for kk in set().union(*per)}
    uninstrument()
    ecat: dict[str, float] = {}
    if not a.no_eager_nodes:  # the same graph, every node through eager kernels
        # the capture again, before decompose.py: eager's own multi-tensor ops
        import types

        from blutrain.compiler.graph import from_capture

        raw = prog.graph.raw
        vals = [dict(v, is_input=v["input"]) for v in raw["values"]]
        g = from_capture(
            types.SimpleNamespace(
                values=vals,
                nodes=raw["nodes"],
                inputs=raw["inputs"],
                outputs=raw["outputs"],
                mutations=raw["mutations"],
                grads=raw["grads"],
                to_dict=lambda: raw,
            )
        )
        allbad = {n.index for n in g.nodes}
        part = fusion.partition(g, allbad)
        eprog = P.Program(g, part, "cpu", g.hash())
        eprog.prepare(set(g.live_out()) | {v for _, v in g.grads} | {v for _, v in g.mutations})
        eprog.plan.buffers.clear()  # eager allocates
        ins0 = c.inputs(cargs())
        # copies: the interpreter must not update the live parameters
        ins = [t.clone() if isinstance(t, bt.Tensor) else t for t in ins0]
        et: dict[str, float] = defaultdict(float)
        from blutrain.compiler import eager

        cat_of = {}
        for n in g.nodes:
            if n.op in ("linear", "matmul", "bmm"):
                cat_of[n.index] = "gemm"
            elif "attention" in n.op:
                cat_of[n.index] = "attention"
            elif n.op in eager.VIEW_OPS:
                cat_of[n.index] = "view"
            elif n.op in eager.EAGER_BY_DESIGN:
                cat_of[n.index] = "eager:" + n.op
            else:
                cat_of[n.index] = "fusable:" + n.op
        f = eager.run

        def timed(n, xs, raw=None):
            t0 = time.perf_counter()
            r = f(n, xs, raw)
            dt = time.perf_counter() - t0
            et[cat_of.get(n.index, "?")] += dt
            if cat_of.get(n.index) == "gemm":
                PER_NODE_EAGER[n.index] += dt
            return r

        eager.run = timed
        eper = []
        for _ in range(max(2, a.steps // 2)):
            et.clear()
            eprog.run(ins)
            eper.append({kk: 1e3 * v for kk, v in et.items()})
        eager.run = f
        ecat = {kk: statistics.median(p.get(kk, 0.0) for p in eper) for kk in set().union(*eper)}
    print(
        f"{a.model} B={a.B} T={a.T} {a.device} (CPU threads {bt.get_num_threads()}): program "
        f"{prog.stats.groups} kernels, {prog.stats.library_calls} library calls, "
        f"{prog.stats.eager_steps} eager steps"
    )
    print(
        f"step (median ms): eager {statistics.median(eager_ms):.1f}  compiled "
        f"{statistics.median(comp_ms):.1f}  (instrumented {sum(rows.values()):.1f})"
    )
    print(f"{'compiled category':28s} {'ms':>8s}")
    for kk, v in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"  {kk:26s} {v:8.2f}")
    if a.top:
        by_id = {G.id: G for G in prog.part.groups}
        print("top kernels (ms a step over the profiled steps)")
        for gid, v in sorted(PER_KERNEL.items(), key=lambda kv: -kv[1])[: a.top]:
            G = by_id[gid]
            ops = [n.op for n in G.compute_nodes()]
            shapes = sorted({prog.graph.values[o].shape for o in G.outputs})
            print(f"  {G.name:6s} {1e3 * v / a.steps:8.2f}  {ops[:12]} outs {shapes[:3]}")
    if ecat:
        print(f"{'eager, node by node':28s} {'ms':>8s}")
        agg: dict[str, float] = defaultdict(float)
        for kk, v in ecat.items():
            agg[kk] += v
        for kk, v in sorted(agg.items(), key=lambda kv: -kv[1])[:30]:
            print(f"  {kk:26s} {v:8.2f}")
        print(f"  {'(sum)':26s} {sum(agg.values()):8.2f}")
        if a.top:
            print("slowest GEMMs: compiled ms, eager ms (a step), shapes")
            ne = max(2, a.steps // 2)
            nodes = {n.index: n for n in prog.graph.nodes}
            for i, v in sorted(PER_NODE.items(), key=lambda kv: -kv[1])[: a.top]:
                n = nodes[i]
                shp = [prog.graph.values[j].shape for j in n.inputs if j >= 0]
                print(
                    f"  node {i:4d} {n.op:7s} {1e3 * v / a.steps:8.2f} "
                    f"{1e3 * PER_NODE_EAGER.get(i, 0.0) / ne:8.2f}  {shp} {n.attrs}"
                )


if __name__ == "__main__":
    main()
