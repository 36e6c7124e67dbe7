"""Which steps of a compiled training step still call the allocator in its steady state.

Runs the LLaMA-style tiny training step of tests/test_compiler_gpu.py (forward, backward,
clipping, AdamW with device scalars) compiled, five calls, and counts blutrain.alloc's
`alloc_count` around every step of the program from the third call on: a fused kernel (its
output buffers and the contiguous copies of its inputs), a GEMM or gather into the arena, an
eager step. What a call allocates outside the steps (the API's guards, mutations copied back,
returned values) is the rest of the call's count.

    python bench/alloc_steps.py --device cuda            # the real kernels (needs PTX or MLIR)
    python bench/alloc_steps.py --device cuda --replay   # no MLIR, no PTX at all
    python bench/alloc_steps.py --device cpu --gpu-partition

--replay runs each fused group as an eager replay of its nodes and does not count what the
replay allocates (only what the program around it does); groups without an eager replay (the
fused AdamW update, sums of squares) leave their outputs unwritten, so the losses are not the
step's, the counts are. With it the program is partitioned and planned as for the real kernels
but never lowered, so it runs on a GPU machine without the MLIR bindings (Note [cache hits
without MLIR] in cache.py). --gpu-partition gives a CPU target the partition CUDA gets (its
CPU-only lowerings, slice_scatter, become eager steps).

Written for session 46's GPU finding: the compiled step made 6 allocator calls a call on CUDA
(test_llama_step_on_gpu_steady_state_makes_no_allocator_call), none on the CPU, none on the
CPU with the GPU partition.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from typing import Any

import numpy as np

import blutrain.alloc as alloc
import blutrain.tensor as bt
from blutrain.compiler import fusion
from blutrain.compiler import program as P

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from check_steps import replay_group  # noqa: E402

_partition = fusion.partition


def _count(dev: str) -> int:
    return int(alloc.stats(dev)["alloc_count"])


def replay_build(gpu_partition: bool):
    """program.build without lowering: the partition, the plan, no kernels."""

    def build(graph: Any, target: str = "cpu", dump: Any = None) -> P.Program:
        from blutrain.compiler.decompose import decompose

        g = decompose(graph, gpu=target.startswith("cuda") or gpu_partition)
        cpu = not (target.startswith("cuda") or gpu_partition)
        prog = P.Program(g, _partition(g, set(), cpu=cpu), target, graph.hash())
        P._fill_stats(prog)
        return prog

    return build


class Counter:
    def __init__(self, dev: str, replay: bool) -> None:
        self.dev, self.replay, self.on = dev, replay, False
        self.steps: collections.Counter = collections.Counter()
        self.in_run = 0
        self.replayed = 0  # what --replay's eager replays allocated (not the program's)

    def add(self, what: str, n: int) -> None:
        if self.on and n:
            self.steps[what] += n
            self.in_run += n


def counting_run(C: Counter):
    def run(self: P.Program, inputs: list[Any]) -> dict[int, Any]:
        """Program.run, step for step, counting the allocator calls of each."""
        g, dev = self.graph, C.dev
        self.ready()
        env: dict[int, Any] = dict(zip(g.inputs, inputs))
        for k, st in enumerate(self.part.steps):
            if isinstance(st, fusion.Group):
                a0 = _count(dev)
                ins = []
                for i in st.inputs:
                    t = self.value(env, i)
                    ins.append(t if t.is_contiguous() else t.contiguous())
                a1 = _count(dev)
                outs = [self._out(o, env) for o in st.outputs]
                a2 = _count(dev)
                if C.replay:
                    r0 = _count(dev)
                    with bt.no_grad():
                        try:
                            ref = replay_group(self, st, env)
                        except NotImplementedError:
                            ref = {}
                        for o, t in zip(st.outputs, outs):
                            if o in ref and ref[o].shape == t.shape:
                                t.copy_(ref[o])
                    del ref
                    a3 = a4 = _count(dev)
                    C.replayed += a4 - r0
                else:
                    a3 = _count(dev)
                    self.kernels[st.id]([t.data_ptr() for t in ins] + [t.data_ptr() for t in outs])
                    a4 = _count(dev)
                for o, t in zip(st.outputs, outs):
                    env[o] = t
                ops = " ".join(n.op for n in st.compute_nodes())[:80]
                C.add(f"step {k} group ({ops}): contiguous copies of inputs", a1 - a0)
                C.add(
                    f"step {k} group ({ops}): output buffers "
                    f"{[g.values[o].shape for o in st.outputs if o not in self.views]}",
                    a2 - a1,
                )
                C.add(f"step {k} group ({ops}): the kernel itself", a4 - a3)
                del ins, outs
            else:
                n = st.node
                a0 = _count(dev)
                args = [self.value(env, i) if i >= 0 else None for i in n.inputs]
                a1 = _count(dev)
                how = {
                    "gemm": "GEMM into the arena",
                    "gather": "gather into the arena",
                    "over": "eager over its base",
                    "eager": f"eager ({st.kind})",
                }[self.eager_step(k, n, args, env)]
                if k in self.scratch_views:
                    how += " in its arena scratch"
                a2 = _count(dev)
                if a2 > a1:  # what the step read: where a library call's own copies come from
                    how += " reading " + ", ".join(
                        f"{tuple(a.shape)}/{tuple(a.stride())}/{a.dtype}"
                        for a in args
                        if hasattr(a, "stride")
                    )
                shapes = [g.values[v].shape for v in n.outputs]
                C.add(f"step {k} {n.op} (node {n.index}): views of its inputs", a1 - a0)
                C.add(f"step {k} {n.op} (node {n.index}) {how} -> {shapes}", a2 - a1)
                del args
            self.end_step(k, env)
        return env

    return run


def llama_step(device: str) -> tuple[Any, Any]:
    """The compiled LLaMA tiny step of test_llama_step_on_gpu_steady_state_makes_no_allocator_call
    and its batch."""
    import blutrain.compiler as btc

    sys.path.insert(0, HERE)
    import llama_ref as L

    cfg = L.Config.preset("tiny")
    cos, sin = (bt.tensor(t).to(device) for t in L.rope_tables(cfg))
    params = {
        k: bt.tensor(v).to(device).requires_grad_(True) for k, v in L.init_weights(cfg).items()
    }
    step, opt = L.bt_models_step(bt, cfg, params, cos, sin)
    x = bt.tensor(np.random.default_rng(0).integers(0, cfg.vocab, (4, cfg.seq))).to(device)
    return (btc.compile(step), opt), x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if bt.cuda_device_count() else "cpu")
    ap.add_argument("--replay", action="store_true", help="groups as eager replays: no MLIR")
    ap.add_argument("--gpu-partition", action="store_true", help="CUDA's partition on a CPU")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--json", help="write the counts here")
    a = ap.parse_args(argv)
    dev = "cuda:0" if a.device.startswith("cuda") else "cpu"
    if a.gpu_partition:
        fusion.partition = lambda g, bad=None, cpu=False: _partition(g, bad, cpu=False)
    if a.replay:
        P.build = replay_build(a.gpu_partition)
    C = Counter(dev, a.replay)
    P.Program.run = counting_run(C)
    (c, opt), x = llama_step(dev)
    per_call, outside = [], []
    for i in range(a.calls):
        C.on = i >= 2
        C.in_run = C.replayed = 0
        before = _count(dev)
        opt.write_device_scalars(1e-3, i + 1)
        mid = _count(dev)
        loss = c(x, x)
        end = _count(dev) - C.replayed
        per_call.append(end - before)
        outside.append({"write_device_scalars": mid - before, "call": end - mid - C.in_run})
    steady = max(1, a.calls - 2)
    print(f"device {dev}, replay {a.replay}, gpu partition {a.gpu_partition or dev != 'cpu'}")
    what = " (--replay: not the step's loss)" if a.replay else ""
    print(f"allocator calls per call: {per_call} (loss {float(loss.item()):.6f}{what})")
    print(f"outside the program's steps, per call: {outside}")
    for what, n in sorted(C.steps.items(), key=lambda kv: -kv[1]):
        print(f"  {n / steady:5.2f} a call  {what}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"per_call": per_call, "outside": outside, "steps": dict(C.steps), "calls": steady},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
