"""A compiled program: fused kernels, library calls and eager steps in order, over buffers.

`build(graph, target)` partitions the graph (fusion.py), lowers every group into one MLIR module
(lower.py), runs the pipelines stage by stage (dumping each when asked) and loads the code;
`Program.run(inputs)` executes the steps. Errors from MLIR become CompileError naming the graph
hash and the stage.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import blutrain.tensor as bt

from . import backend_cpu, eager, fusion, pipelines, recompute
from .graph import Graph, Node

log = logging.getLogger("blutrain.compiler")


class CompileError(RuntimeError):
    """MLIR failed: names the graph hash, the stage and where the dump is."""


@dataclass
class Stats:
    nodes: int = 0
    groups: int = 0
    fused_nodes: int = 0
    library_calls: int = 0
    eager_steps: int = 0
    fallbacks: int = 0
    compile_s: float = 0.0
    cache: str = "miss"
    recomputed: int = 0
    planned_bytes: int = 0
    compiled_functions: int = 0  # distinct group bodies compiled (Note [identical groups])
    stage_s: dict[str, float] = field(default_factory=dict)


RETURN_SLOTS = 2  # buffers per returned value (Note [returned buffers])


def _contig_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= s
    return tuple(st[::-1])


class Program:
    def __init__(self, graph: Graph, part: fusion.Partition, target: str, ghash: str) -> None:
        self.graph, self.part, self.target, self.hash = graph, part, target, ghash
        self.kernels: dict[int, Any] = {}
        self.stats = Stats()
        self.prod = graph.producer()
        self.keep: Any = None
        self.plan: Any = None  # memplan.Plan, made by prepare()
        self.arena: Any = None
        self.views: dict[int, Any] = {}
        self.scratch_views: dict[int, Any] = {}  # step -> its eager op's scratch region
        self.step_scratch: dict[int, int] = {}  # step -> the region's plan key
        self.scratch_keys: dict[int, list[int]] = {}  # group id -> its temporaries' plan keys
        # GEMM node -> (operands' signature, blutrain.linalg plan): Note [GEMM plans]
        self.gemm_plans: dict[int, tuple[tuple, Any]] = {}
        self.escaping: set[int] = set()
        self.copied_until: dict[int, int] = {}  # value -> the step whose write-back reads it
        self.inplace: dict[int, int] = {}  # value -> the graph input it is written into
        self.free_after: dict[int, list[int]] = {}  # step -> values dropped after it
        self.views_of: dict[int, list[int]] = {}
        self.alias: dict[int, int] = {}  # value -> the value whose buffer it shares
        self.over: set[int] = set()  # eager nodes run over their first input's memory
        # step -> (graph input, its new value) copied in after it (Note [mutations written back
        # early])
        self.writeback: dict[int, list[tuple[int, int]]] = {}
        # values returned to the caller -> their buffers (Note [returned buffers])
        self.returned: dict[int, list[Any]] = {}
        self._sink_constants()
        # the last step that reads each value (for freeing buffers as the program runs)
        self.last_use: dict[int, int] = {}
        for k, st in enumerate(part.steps):
            nodes = st.nodes if isinstance(st, fusion.Group) else [st.node]
            for n in nodes:
                for i in n.inputs:
                    if i >= 0:
                        self.last_use[self.base(i)] = k

    def _sink_constants(self) -> None:
        """Groups that read nothing, or only inputs the call never writes (zeros for a
        gradient's padding, iotas, an optimizer's `1 - lr * wd` or bias corrections from the
        learning rate and step count), run just before their first reader rather than where
        the partition put them: a vocabulary-sized zeros made early stays live beside the
        logits and their gradient, a third buffer of that size eager never holds, and a
        scalar made at the start holds its arena bytes through every step before its reader.
        Only the order of steps changes, never what they compute: what they read has the same
        value at every step of the call."""
        g = self.graph
        fixed = set(g.inputs) - {i for i, _ in g.mutations}
        steps = list(self.part.steps)
        movable = [
            s
            for s in steps
            if isinstance(s, fusion.Group) and all(self.base(i) in fixed for i in s.inputs)
        ]
        for G in movable:
            outs = set(G.outputs)
            steps.remove(G)
            first = len(steps)
            for k, st in enumerate(steps):
                reads = st.inputs if isinstance(st, fusion.Group) else st.node.inputs
                if any(i >= 0 and self.base(i) in outs for i in reads):
                    first = k
                    break
            steps.insert(first, G)
        self.part.steps = steps

    def base(self, v: int) -> int:
        while v in self.prod and self.prod[v].op in eager.VIEW_OPS:
            v = self.prod[v].inputs[0]
        return v

    def value(self, env: dict[int, Any], v: int) -> Any:
        """The tensor of value v: a base from env, views applied eagerly."""
        t = env.get(v)
        if t is not None:
            return t
        n = self.prod.get(v)
        if n is None or n.op not in eager.VIEW_OPS:
            raise RuntimeError(f"[compile] internal: value %{v} was not computed")
        (t,) = eager.run(n, [self.value(env, n.inputs[0])])
        env[v] = t
        return t

    # ---- the memory plan --------------------------------------------------------------------
    def prepare(self, escaping: set[int]) -> None:
        """Plans the arena (once): every non-escaping kernel / GEMM output at a fixed offset;
        optimizer updates written into the tensors they update (Note [in-place updates]); the
        steps after which each value is dropped (Note [freeing at last use])."""
        from . import memplan

        self.escaping = {self.base(v) for v in escaping}
        self.inplace = self._inplace_updates()
        plannable: dict[int, int] = {}
        for k, st in enumerate(self.part.steps):
            if isinstance(st, fusion.Group):
                for o in st.outputs:
                    if o not in self.inplace:
                        plannable[o] = k
            elif st.kind == "library" and _gemm_out_ok(self.graph, st.node):
                plannable[st.node.outputs[0]] = k
            elif _gather_out_ok(self.graph, st.node):
                plannable[st.node.outputs[0]] = k
        early = self._early_writebacks(plannable)
        self.copied_until = early  # a value written back is read by its copy until then
        ends = self._shared_buffers(plannable)
        for v, end in early.items():
            ends[v] = max(ends.get(v, -1), end)
        for v in self.alias:
            plannable.pop(v, None)
        self.plan = memplan.make(self, plannable, self.escaping, ends, self._scratch())
        g = self.graph
        grads_muts = {v for _, v in g.grads} | {v for _, v in g.mutations}
        self.returned = {v: [] for v in g.outputs if v not in grads_muts and self.base(v) == v}
        self.stats.planned_bytes = self.plan.size
        self._free_schedule()

    def _scratch(self) -> list[tuple[int, int, int]]:
        """(key, bytes, step) for every temporary of every fused kernel; fills
        self.scratch_keys (group id -> its temporaries' keys, in the kernel's order).

        Note [kernel temporaries in the arena]: a GPU kernel group may keep values between its
        launches (a column reduction's partial sums, a row kernel's intermediate written by one
        launch and read by the next); the outlined host function allocates them
        (backend_gpu.GpuFunction.temps). A kernel that allocates its own once keeps them for the
        program's life: 449 MiB for LLaMA small's step (B8 x T512), none of which eager holds.
        They live only while their step runs, so the plan places them in the arena like any
        buffer written and last read at that step: one step's temporaries at a time, sharing
        bytes with buffers dead by then. Keys are negative (graph values are not)."""
        out: list[tuple[int, int, int]] = []
        self.scratch_keys, self.step_scratch = {}, {}
        for k, st in enumerate(self.part.steps):
            if not isinstance(st, fusion.Group):
                nbytes = self._eager_scratch_bytes(st.node)
                if nbytes:
                    self.step_scratch[k] = -1 - len(out)
                    out.append((self.step_scratch[k], nbytes, k))
                continue
            fn = getattr(self.kernels.get(st.id), "fn", None)
            for _, _, nbytes in getattr(fn, "temps", None) or ():
                key = -1 - len(out)
                out.append((key, max(1, nbytes), k))
                self.scratch_keys.setdefault(st.id, []).append(key)
        return out

    def _eager_scratch_bytes(self, n: Node) -> int:
        """Scratch an eager step takes from a region the program gives it (blutrain.tensor's Note
        [caller-given scratch]) rather than from the allocator: index_add on CUDA (an
        embedding's gradient: its sort keys and partial sums, six allocations a call)."""
        if n.op != "index_add" or not self.target.startswith("cuda"):
            return 0
        g = self.graph
        base, idx = g.values[n.inputs[0]], g.values[n.inputs[1]]
        d = int(n.attrs.get("dim", 0)) % max(1, len(base.shape))
        D = base.shape[d] if base.shape else 1
        cols = math.prod(base.shape) // max(1, D)
        J = math.prod(idx.shape)
        return int(bt._tensor._index_add_scratch_bytes(base.device, J, D, cols, base.dtype))

    def _inplace_updates(self) -> dict[int, int]:
        """value -> graph input it may be written into: the new parameter / moments of an
        `adamw_update` group, when nothing after that group reads the old tensor.

        Note [in-place updates]: the caller copies each mutation's final value into its input
        tensor; an optimizer update computed into fresh memory and then copied costs three
        parameter-sized buffers (p', m', v') at once, which eager's in-place AdamW never holds.
        Written in place, the copy disappears. Safe only where every read of the old tensor is
        at the index being written: a group of adamw_update nodes only (elementwise; the
        kernels read p, g, m, v at element j before writing element j of p', m', v', and m'
        and v' do not depend on p; not with a 16-bit copy, whose cast of p' fusion may
        recompute from p, m, v after they were overwritten), no later step reads the old
        tensor (last use at this group), and no output or gradient is a view of it (it is read
        after the run)."""
        g = self.graph
        ins = set(g.inputs)
        out_bases = {self.base(v) for v in g.outputs} | {self.base(v) for _, v in g.grads if v >= 0}
        step_of: dict[int, int] = {}
        for k, st in enumerate(self.part.steps):
            if (
                isinstance(st, fusion.Group)
                and st.compute_nodes()
                and all(
                    n.op == "adamw_update" and not n.attrs.get("has_copy")
                    for n in st.compute_nodes()
                )
            ):
                for o in st.outputs:
                    step_of[o] = k
        res: dict[int, int] = {}
        taken: set[int] = set()
        for i, v in g.mutations:
            k = step_of.get(v)
            if k is None or i not in ins or i in out_bases or i in taken or v in res:
                continue
            if v in g.outputs or any(v == w for _, w in g.grads):
                continue
            vi, vv = g.values[i], g.values[v]
            if (vi.shape, vi.dtype, vi.device) != (vv.shape, vv.dtype, vv.device):
                continue
            if self.last_use.get(i, -1) > k:
                continue
            res[v] = i
            taken.add(i)
        return res

    def _early_writebacks(self, plannable: dict[int, int]) -> dict[int, int]:
        """Fills self.writeback; returns, per value written back, the step its buffer must
        last to (the copy's).

        Note [mutations written back early]: a function that updates its inputs in place with
        ops (an optimizer written as `p.sub_(...)`, `m.mul_(b1).add_(...)`) leaves each new
        value in a kernel's output, and the caller copies it into the input after the call.
        Kept in a fresh buffer until then, every new p, m and v of every parameter is live at
        once at the end: three optimizer states eager never holds, and an allocation each per
        call. Instead, right after the step that computes a new value, or after the last step
        that reads the old input if that comes later, the program copies it into the input and
        the name refers to the input from then on: the value's buffer is planned in the arena
        and is dead after the copy, so one parameter's update at a time occupies it, with no
        allocation. Writing the kernel's output over the input directly (Note [in-place
        updates]) saves the copy but is safe only where every read of the input is at the
        element being written, which a fused kernel does not promise in general. Values the
        caller also sees (an output, a .grad) keep the copy at the end."""
        g = self.graph
        ins = set(g.inputs)
        seen = {self.base(v) for v in g.outputs} | {self.base(v) for _, v in g.grads if v >= 0}
        ends: dict[int, int] = {}
        for i, v in g.mutations:
            if v in self.inplace or i not in ins or v not in plannable or v in seen:
                continue
            vi, vv = g.values[i], g.values[v]
            if (vi.shape, vi.dtype) != (vv.shape, vv.dtype) or self.base(v) != v or v in ends:
                continue
            k = plannable[v]
            c = max(k, self.last_use.get(i, -1))
            self.writeback.setdefault(c, []).append((i, v))
            self.escaping.discard(v)
            ends[v] = max(c, self.last_use.get(v, k))
        return ends

    def _shared_buffers(self, plannable: dict[int, int]) -> dict[int, int]:
        """Values that take over the memory of another (self.alias: value -> the value whose
        buffer it writes); returns, per buffer so shared, the last step any sharer reads.

        Note [shared buffers]: eager frees nothing it can reuse: autograd hands an unused
        gradient to `.grad` as is, and accumulates an embedding's gradient into the buffer of
        the other contribution (index_add over its base). Without the same reuse, a compiled
        step holds two or three vocabulary-sized gradients at once. Three kinds:
          - identity: accumulate_grad with no previous .grad writes exactly its input's values;
            written over the input's own buffer, every element keeps its value whatever order
            the kernel reads and writes in;
          - over base: index_add and slice_scatter (eager steps) written over their first
            input, when nothing reads that buffer afterwards (every sharer's last use at this
            step at the latest) and the caller never sees it (no sharer escapes);
          - over a dead input: a fused group's output over an input that dies there, under
            the same conditions, where the group's kernels read each element of the input
            before they write the output's (a loss's dlogits over the logits, as eager's Note
            [donating a saved input]; Note [outputs over dead inputs] in backend_gpu.py).
        A result the caller keeps (it escapes) shares only memory outside the arena."""
        g = self.graph
        ins = set(g.inputs)
        root: dict[int, int] = {}  # value -> the value whose buffer it uses
        members: dict[int, list[int]] = {}
        self.alias: dict[int, int] = {}
        self.over: set[int] = set()  # node indices run by eager.run_over_base

        def rt(v: int) -> int:
            return root.get(v, v)

        def ok(o: int, src: int) -> bool:
            vo, vs = g.values[o], g.values[src]
            if self.base(src) != src or src in ins or o in self.inplace:
                return False
            if (vo.shape, vo.dtype, vo.device) != (vs.shape, vs.dtype, vs.device):
                return False
            return not (o in self.escaping and rt(src) in plannable)

        def share(o: int, src: int) -> None:
            r = rt(src)
            self.alias[o] = src
            root[o] = r
            members.setdefault(r, [r]).append(o)

        def dead_after(src: int, k: int) -> list[int] | None:
            """The values sharing src's buffer, if none escapes or is read after step k."""
            group = members.get(rt(src), [rt(src)])
            for m in group:
                if m in self.escaping or self.last_use.get(m, -1) > k:
                    return None
                if self.copied_until.get(m, -1) > k:  # Note [mutations written back early]
                    return None
            return group

        for k, st in enumerate(self.part.steps):
            if isinstance(st, fusion.Group):
                for n in st.compute_nodes():
                    if n.op != "accumulate_grad" or (len(n.inputs) > 2 and n.inputs[2] >= 0):
                        continue
                    o, src = n.outputs[0], n.inputs[1]
                    if o in st.outputs and src in st.inputs and ok(o, src):
                        share(o, src)
                # Note [outputs over dead inputs] (backend_gpu.py): the kernel allows it
                fn = getattr(self.kernels.get(st.id), "fn", None)
                args = list(st.inputs) + list(st.outputs)
                for oa, ia in getattr(fn, "inplace", None) or ():
                    if ia >= len(st.inputs) or oa < len(st.inputs) or oa >= len(args):
                        continue
                    o, src = args[oa], args[ia]
                    if o in self.alias or src in self.alias.values() or not ok(o, src):
                        continue
                    group = dead_after(src, k)
                    if group is None or args.count(src) != 1:
                        continue
                    if any(self.base(i) in group for i in st.inputs if i != src):
                        continue  # another argument reads the buffer o would overwrite
                    share(o, src)
                continue
            n = st.node
            if n.op not in eager.OVER_BASE or g.raw is None or not n.outputs:
                continue
            o, src = n.outputs[0], n.inputs[0]
            if not ok(o, src):
                continue
            group = dead_after(src, k)
            if group is None:
                continue
            if any(self.base(i) in group for i in n.inputs[1:] if i >= 0):
                continue  # reads the buffer it would overwrite
            share(o, src)
            self.over.add(n.index)
        ends: dict[int, int] = {}
        for r, ms in members.items():
            ends[r] = max(self.last_use.get(m, -1) for m in ms)
        return ends

    def _free_schedule(self) -> None:
        """Note [freeing at last use]: run() drops each value (and the views made of it) from
        its environment after the last step that reads it, as eager's reference counting
        frees a temporary: eager steps' outputs and contiguous copies do not pile up until the
        call ends. Values the caller reads (outputs, gradients, mutations) and graph inputs
        stay."""
        g = self.graph
        keep = set(self.escaping) | set(g.inputs)
        keep |= {v for wb in self.writeback.values() for _, v in wb}  # (they name the inputs)
        written: dict[int, int] = {}
        for k, st in enumerate(self.part.steps):
            outs = st.outputs if isinstance(st, fusion.Group) else st.node.outputs
            for o in outs:
                written[o] = k
        self.views_of: dict[int, list[int]] = {}
        for v, n in self.prod.items():
            if n.op in eager.VIEW_OPS:
                self.views_of.setdefault(self.base(v), []).append(v)
        self.free_after: dict[int, list[int]] = {}
        for v, k in written.items():
            if v in keep or self.base(v) != v:
                continue
            self.free_after.setdefault(max(k, self.last_use.get(v, k)), []).append(v)

    def _arena_views(self) -> None:
        from . import _runtime

        g = self.graph
        dev = next((g.values[v].device for v in self.plan.buffers if v >= 0), self.target)
        self.arena = bt.empty((max(self.plan.size, 1),), dtype=bt.uint8, device=dev)
        base = self.arena.data_ptr()
        for gid, keys in self.scratch_keys.items():  # Note [kernel temporaries in the arena]
            self.kernels[gid].temp_ptrs = [base + self.plan.buffers[key].offset for key in keys]
        dl_dev = (
            (2, int(dev.split(":")[1]) if ":" in dev else 0) if dev.startswith("cuda") else (1, 0)
        )
        for k, key in self.step_scratch.items():  # (eager steps' scratch regions)
            b = self.plan.buffers[key]
            arr = _runtime.view(base + b.offset, [b.nbytes], [1], 1, 8, *dl_dev, self.arena)
            self.scratch_views[k] = bt.from_dlpack(arr)
        for v, b in self.plan.buffers.items():
            if v < 0:  # a kernel's temporary
                continue
            val = g.values[v]
            code, bits = _DLPACK[val.dtype]
            arr = _runtime.view(
                base + b.offset,
                list(val.shape),
                list(_contig_strides(val.shape)),
                code,
                bits,
                dl_dev[0],
                dl_dev[1],
                self.arena,
            )
            self.views[v] = bt.from_dlpack(arr)

    def fresh_values(self) -> list[int]:
        """The values a steady-state call allocates (prepare() first): what the caller keeps
        (gradients, updates not written in place, returned values an eager step computes) and
        the outputs of eager steps blutrain.tensor cannot write into given memory. Every other
        value lives in the arena, in memory it shares (Note [shared buffers]), in the tensor it
        updates (Note [in-place updates]) or, returned by a fused kernel, in a buffer the
        caller has let go of (Note [returned buffers]: the usual loop, which drops a call's
        results by the call after next)."""
        out: list[int] = []
        for st in self.part.steps:
            if isinstance(st, fusion.Group):
                outs = [o for o in st.outputs if o not in self.returned]
            elif st.node.op in eager.VIEW_OPS or st.node.index in self.over:
                continue
            else:
                outs = st.node.outputs
            out += [o for o in outs if o not in self.views and o not in self.inplace]
        return [o for o in out if o not in self.alias and o not in self.plan.buffers]

    def _out(self, v: int, env: dict[int, Any]) -> Any:
        t = self.views.get(v)
        if t is not None:
            return t
        i = self.inplace.get(v)
        if i is None:
            i = self.alias.get(v)  # Note [shared buffers]
        if i is not None:  # Note [in-place updates]
            t = self.value(env, i)
            if t.is_contiguous():
                return t
        if v in self.returned:
            return self._returned_buffer(v)
        val = self.graph.values[v]
        return bt.empty(val.shape, dtype=getattr(bt, val.dtype), device=val.device)

    def _returned_buffer(self, v: int) -> Any:
        """Note [returned buffers]: a value the call returns (a loss, a gradient norm) is the
        caller's, so it cannot live in the arena; allocated fresh it is the steady state's
        last allocator call. Each returned value keeps RETURN_SLOTS buffers and the call
        writes one the caller no longer holds: no Python reference but ours and no other
        tensor on its memory (a view, a detach(), an autograd record: `_sole_owner`). In the
        usual loop (`loss = step(x)` keeps the previous call's loss alive during this call)
        two slots take turns and nothing is allocated; a caller who keeps every loss gets a
        fresh tensor each call. A buffer someone still reads is never written."""
        slots = self.returned.setdefault(v, [])
        for t in slots:
            # references: the list, this loop's name, getrefcount's argument
            if sys.getrefcount(t) <= 3 and t._sole_owner():
                return t
        val = self.graph.values[v]
        t = bt.empty(val.shape, dtype=getattr(bt, val.dtype), device=val.device)
        if len(slots) < RETURN_SLOTS:
            slots.append(t)
        return t

    def ready(self) -> None:
        """The plan and the arena, made at the first call (run() and the benchmarks'
        step-by-step copies of it)."""
        if self.plan is None:
            self.prepare(set(self.graph.live_out()))
        if self.arena is None and self.plan.buffers:
            self._arena_views()

    def run(self, inputs: list[Any]) -> dict[int, Any]:
        g = self.graph
        self.ready()
        env: dict[int, Any] = {}
        for vid, t in zip(g.inputs, inputs):
            env[vid] = t
        for k, st in enumerate(self.part.steps):
            if isinstance(st, fusion.Group):
                ins = []
                for i in st.inputs:
                    t = self.value(env, i)
                    if not t.is_contiguous():
                        t = t.contiguous()
                    ins.append(t)
                outs = [self._out(o, env) for o in st.outputs]
                self.kernels[st.id]([t.data_ptr() for t in ins] + [t.data_ptr() for t in outs])
                for o, t in zip(st.outputs, outs):
                    env[o] = t
                del ins, outs
            else:
                n = st.node
                args = [self.value(env, i) if i >= 0 else None for i in n.inputs]
                self.eager_step(k, n, args, env)
                del args
            self.end_step(k, env)
        return env

    def eager_step(self, k: int, n: Node, args: list[Any], env: dict[int, Any]) -> str:
        """Runs step k, node n outside the fused kernels, its outputs into env; returns how:
        "gemm" / "gather" (into the arena), "over" (over its base: Note [shared buffers]) or
        "eager". The benchmarks' step-by-step copies of run() call it too."""
        o = n.outputs[0] if n.outputs else -1
        if o in self.views and self.part.steps[k].kind == "library":
            _gemm_into(n, args, self.views[o], self.gemm_plans)
            env[o] = self.views[o]
            return "gemm"
        if o in self.views and n.op == "index_select":
            _gather_into(n, args, self.views[o])
            env[o] = self.views[o]
            return "gather"
        raw = self.graph.raw
        if n.index in self.over and args[0].is_contiguous():
            how, fn = "over", lambda: eager.run_over_base(n, args, raw)
        else:
            how, fn = "eager", lambda: eager.run(n, args, raw)
        region = self.scratch_views.get(k)  # Note [kernel temporaries in the arena]
        res = fn() if region is None else bt._tensor._with_scratch(region, fn)
        for v, t in zip(n.outputs, res):
            env[v] = t
        return how

    def end_step(self, k: int, env: dict[int, Any]) -> None:
        """After step k: mutations copied into their inputs (Note [mutations written back
        early]) and values dropped at their last use (Note [freeing at last use]). The
        benchmarks' step-by-step copies of run() (check_steps, alloc_steps) call it too."""
        for i, v in self.writeback.get(k, ()):
            dst = env[i]
            with bt.no_grad():
                dst.copy_(env[v])
            env[v] = dst
            for w in self.views_of.get(v, ()):
                env.pop(w, None)
        for v in self.free_after.get(k, ()):
            env.pop(v, None)
            for w in self.views_of.get(v, ()):
                env.pop(w, None)

    # ---- building ---------------------------------------------------------------------------
    def lower_all(self) -> Any:
        """One MLIR module with a function per group (the 'lowered' stage)."""
        from mlir import ir

        from .lower import Emitter

        module = ir.Module.create()
        for G in self.part.groups:
            cpu = not self.target.startswith("cuda")
            Emitter(self.graph, G.nodes, G.inputs, G.outputs, G.name, cpu=cpu).build(module)
        return module


def _fill_stats(prog: Program) -> None:
    st, part = prog.stats, prog.part
    st.nodes = len(prog.graph.nodes)
    st.groups = len(part.groups)
    st.fused_nodes = sum(len(G.compute_nodes()) for G in part.groups)
    st.library_calls = sum(
        1 for s in part.steps if isinstance(s, fusion.EagerStep) and s.kind == "library"
    )
    st.eager_steps = sum(1 for s in part.steps if isinstance(s, fusion.EagerStep))
    st.fallbacks = len(part.fallbacks)


# Note [identical groups]: a model's layers repeat, so most fused groups are the same function
# under another name (LLaMA tiny with 8 layers: 323 groups, 32 distinct bodies; 2 layers: 89
# and 32), and compiling each copy cost time linear in the layers or worse (PTX for the
# 8-layer step: 191 s, against 10 s for 2 layers, same machine). A group's lowered function
# states everything its kernel computes (shapes, dtypes, constants, the order of its arguments:
# its inputs then its outputs), so groups whose functions print the same apart from their
# names run one compiled kernel, each on its own pointers. The duplicates are removed from the
# module before any pass (`dedup_groups`); the first group of each body names the kernel
# (`aliases`: duplicate -> that name). Cached entries keep the map (CPU: in meta.json; GPU: each
# name's launch plan in gpu.json).
def dedup_groups(module: Any) -> dict[str, str]:
    """Erases the functions of `module` whose text equals an earlier one's but for the name;
    returns {erased name: the kept function's name}."""
    first: dict[str, str] = {}
    aliases: dict[str, str] = {}
    for op in list(module.body.operations):
        if op.operation.name != "func.func":
            continue
        name = op.attributes["sym_name"].value
        key = str(op).replace(f"@{name}(", "@_(", 1)
        if key in first:
            aliases[name] = first[key]
            op.operation.erase()
        else:
            first[key] = name
    return aliases


def _load_cached(graph: Graph, target: str, centry: Any, t0: float, dump: Any) -> Program | None:
    """A program from a cache entry, with no MLIR at all (the bindings need not be installed)."""
    gpu = target.startswith("cuda")
    hit = centry.load("gpu.json" if gpu else "kernels.so")
    if hit is None:
        return None
    path, meta = hit
    bad = set(meta.get("unlowerable", []))
    aliases = dict(meta.get("aliases", {}))  # Note [identical groups]
    part = fusion.partition(graph, bad, cpu=not gpu)
    prog = Program(graph, part, target, graph.hash())
    try:
        if gpu:
            from . import _runtime, backend_gpu

            with open(path) as f:
                code = backend_gpu.GpuCode.from_json(f.read())
            mods = {
                name: _runtime.Module(text.encode(), _device_index(target))
                for name, text in code.ptx.items()
            }
            prog.keep = mods
            prog.gpu_code = code
            for G in part.groups:
                prog.kernels[G.id] = backend_gpu.GpuKernel(code.functions[G.name], mods, target)
        else:
            lib = backend_cpu.SharedLib(path)
            for G in part.groups:
                prog.kernels[G.id] = backend_cpu.CpuKernel(
                    lib.address(aliases.get(G.name, G.name)), *_sig(graph, G), lib
                )
            prog.keep = lib
    except (OSError, AttributeError, KeyError, ValueError) as e:
        log.warning("[compile] cache entry %s cannot be loaded (%s): rebuilding", centry.path, e)
        return None
    _fill_stats(prog)
    prog.stats.cache = "hit"
    prog.stats.compile_s = time.perf_counter() - t0
    if dump:
        dump.write("graph.json", graph.to_json())
        dump.write("groups.txt", describe(graph, part))
    return prog


def build(graph: Graph, target: str = "cpu", dump: Any = None) -> Program:
    """Partition, lower, fuse and compile `graph` for target ("cpu" or "cuda[:N]"), or load it
    from the disk cache."""
    from . import cache

    t0 = time.perf_counter()
    ghash = graph.hash()
    centry = cache.Entry(cache.key(graph.hash_full(), target, ""))
    from .decompose import decompose

    graph = decompose(graph, gpu=target.startswith("cuda"))
    prog0 = _load_cached(graph, target, centry, t0, dump)
    if prog0 is not None:
        return prog0

    from mlir import ir
    from mlir.passmanager import PassManager

    from .lower import Emitter, LoweringError

    gpu_t = target.startswith("cuda")
    bad: set[int] = set()
    # lower the groups; a node that fails runs eagerly and the partition is redone
    for _attempt in range(16):
        part = fusion.partition(graph, bad, cpu=not gpu_t)
        prog = Program(graph, part, target, ghash)
        ctx = ir.Context()
        with ctx, ir.Location.unknown():
            module = ir.Module.create()
            failed = None
            for G in part.groups:
                em = Emitter(graph, G.nodes, G.inputs, G.outputs, G.name, cpu=not gpu_t)
                try:
                    em.build(module)
                except LoweringError as e:
                    failed = (G, e, em)
                    break
            if failed is None:
                break
            G, e, em = failed
            node = _failing_node(graph, G, em)
            log.warning(
                "[compile] %s (node %d) cannot be lowered (%s): it runs eagerly",
                node.op,
                node.index,
                e,
            )
            bad.add(node.index)
    else:
        raise CompileError(f"[compile] graph {ghash}: too many unlowerable nodes")
    _fill_stats(prog)
    st = prog.stats
    for n in part.fallbacks:
        log.warning("[compile] eager fallback for %s (node %d) in graph %s", n.op, n.index, ghash)
    meta = {"graph": ghash, "target": target, "unlowerable": sorted(bad)}
    with ctx, ir.Location.unknown():
        if dump:
            dump.write("graph.json", graph.to_json())
            dump.write("graph.txt", str(graph))
            dump.write("groups.txt", describe(graph, part))
        if not module.operation.verify():
            raise CompileError(
                f"[compile] graph {ghash}: stage lowered: the module does not verify"
            )
        aliases = dedup_groups(module)  # Note [identical groups]
        meta["aliases"] = aliases
        st.compiled_functions = len(part.groups) - len(aliases)
        if dump and aliases:
            dump.write("aliases.txt", "".join(f"{d} = {k}\n" for d, k in aliases.items()))
        gpu = target.startswith("cuda")
        buf = pipelines.BUFFERIZE if gpu else pipelines.BUFFERIZE_CPU
        stages = [("fused", pipelines.FUSE), ("bufferized", buf)]
        if not gpu:
            par = _parallel_groups(graph, part) if backend_cpu.omp_threads() else set()
            stages += [("loops", lambda m: _cpu_loops(m, par)), ("llvm", pipelines.CPU_LLVM)]
        if dump:
            dump.write("00-lowered.mlir", str(module))
        for k, (name, pipe) in enumerate(stages, 1):
            ts = time.perf_counter()
            try:
                if name == "fused":
                    st.recomputed = recompute.duplicate(module)
                if callable(pipe):
                    pipe(module)
                else:
                    PassManager.parse(pipe).run(module.operation)
            except Exception as e:  # MLIR diagnostics arrive as a RuntimeError / MLIRError
                raise CompileError(
                    f"[compile] graph {ghash}: stage {name} failed ({_where(dump)}): {e}"
                ) from e
            st.stage_s[name] = time.perf_counter() - ts
            if dump:
                dump.write(f"{k:02d}-{name}.mlir", str(module))
        if gpu:
            from . import backend_gpu

            try:
                code = backend_gpu.compile_module(module, dump, st.stage_s)
            except Exception as e:
                raise CompileError(
                    f"[compile] graph {ghash}: stage ptx failed ({_where(dump)}): {e}"
                ) from e
            prog.gpu_code = code
            if code.unsupported:
                raise CompileError(
                    f"[compile] graph {ghash}: stage gpu-host ({_where(dump)}): "
                    + "; ".join(f"{k}: {v}" for k, v in code.unsupported.items())
                )
            for d, k in aliases.items():
                code.functions[d] = code.functions[k]
            centry.store("gpu.json", code.to_json().encode(), meta)
            from . import _runtime

            mods = {
                name: _runtime.Module(text.encode(), _device_index(target))
                for name, text in code.ptx.items()
            }
            prog.keep = (ctx, mods)
            for G in part.groups:
                prog.kernels[G.id] = backend_gpu.GpuKernel(code.functions[G.name], mods, target)
            st.compile_s = time.perf_counter() - t0
            return prog
        ts = time.perf_counter()
        engine = backend_cpu.jit(module)
        st.stage_s["jit"] = time.perf_counter() - ts
        prog.keep = (ctx, engine)
        for G in part.groups:
            prog.kernels[G.id] = backend_cpu.PackedKernel(
                backend_cpu.lookup(engine, aliases.get(G.name, G.name)), *_sig(graph, G), engine
            )
        if centry.path is not None:
            ts = time.perf_counter()
            import tempfile

            obj = backend_cpu.object_code(engine)
            with tempfile.TemporaryDirectory() as d:
                so = os.path.join(d, "kernels.so")
                if backend_cpu.link_shared(obj, so):
                    with open(so, "rb") as f:
                        centry.store("kernels.so", f.read(), meta)
            st.stage_s["cache_write"] = time.perf_counter() - ts
    st.compile_s = time.perf_counter() - t0
    return prog


def _parallel_groups(graph: Graph, part: fusion.Partition) -> set[str]:
    """Names of the groups big enough for parallel loops (Note [parallel CPU loops])."""
    out = set()
    for G in part.groups:
        vals = set(G.inputs) | {o for n in G.nodes for o in n.outputs}
        if max((graph.values[v].numel for v in vals), default=0) >= pipelines.PARALLEL_MIN:
            out.add(G.name)
    return out


def _cpu_loops(module: Any, parallel: set[str]) -> None:
    """The CPU loops stage: temporaries placed, then each function's linalg ops as serial loops
    or, for the groups in `parallel`, OpenMP worksharing loops (Note [parallel CPU loops])."""
    from mlir.passmanager import PassManager

    _strided_copies_as_loops(module)
    PassManager.parse(pipelines.CPU_PREP).run(module.operation)
    PassManager.parse(pipelines.CPU_TO_LOOPS).run(module.operation)
    _fold_unit_subviews(module)
    _fold_view_chain_loads(module)
    _fuse_row_loops(module)
    serial = PassManager.parse(pipelines.CPU_SERIAL)
    par = PassManager.parse(pipelines.CPU_PARALLEL)
    for op in module.body.operations:
        if op.operation.name != "func.func":
            continue
        name = op.operation.attributes["sym_name"].value
        _run_reporting(par if name in parallel else serial, op.operation)
    _serialize_small_nests(module, pipelines.PARALLEL_MIN)
    PassManager.parse(pipelines.CPU_OMP).run(module.operation)
    _nowait_sole_loops(module)


def _const_index(v: Any) -> int | None:
    op = v.owner
    op = getattr(op, "operation", op)
    if getattr(op, "name", "") != "arith.constant":
        return None
    from mlir import ir

    return int(ir.IntegerAttr(op.attributes["value"]).value)


def _nest_work(region: Any) -> int | None:
    """Iterations of the innermost bodies of the loops in `region` (elements: a loop's trip is
    ub - lb, its step ignored, so an 8-wide vector loop counts its elements); None where a bound
    is not a constant."""
    tot = 0
    for blk in region.blocks:
        for op in blk.operations:
            o = op.operation
            if o.name in ("scf.for", "scf.parallel"):
                n = len(o.regions[0].blocks[0].arguments) if o.name == "scf.parallel" else 1
                trip = 1
                for d in range(n):
                    lb, ub = _const_index(o.operands[d]), _const_index(o.operands[n + d])
                    if lb is None or ub is None:
                        return None
                    trip *= max(ub - lb, 0)
                inner = _nest_work(o.regions[0])
                if inner is None:
                    return None
                tot += trip * max(inner, 1)
                continue
            for r in o.regions:
                w = _nest_work(r)
                if w is None:
                    return None
                tot += w
    return tot


def _serialize_small_nests(module: Any, min_work: int) -> int:
    """Note [small nests stay serial]: a parallel kernel's every loop nest became a parallel
    loop, and each is a fork and join of the thread team: the big nest that made the kernel
    parallel, but also its row statistics (128 rows of a loss), lane fills and scalars. A
    GPT-2 tiny step had 205 forks; on a shared machine each fork waits for every thread of
    the team to be scheduled, so they cost far more than the work they split. A 1-D
    scf.parallel whose nest does fewer than min_work iterations (PARALLEL_MIN, eager's own
    size for going parallel) becomes the serial scf.for it was; its body is unchanged, so are
    the numbers. Returns how many."""
    from mlir import ir
    from mlir.dialects import scf

    pars: list[Any] = []

    def find(op: Any) -> Any:
        if op.name == "scf.parallel":
            pars.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(find)
    done = 0
    for p in pars:
        body = p.regions[0].blocks[0]
        if len(body.arguments) != 1 or len(p.results) or len(p.operands) != 3:
            continue  # multi-dimensional, or with reductions: left alone
        w = _nest_work(p.regions[0])
        lb, ub = _const_index(p.operands[0]), _const_index(p.operands[1])
        if w is None or lb is None or ub is None or (ub - lb) * max(w, 1) >= min_work:
            continue
        with ir.InsertionPoint(p), p.location:
            loop = scf.ForOp(p.operands[0], p.operands[1], p.operands[2])
        with ir.InsertionPoint(loop.body), p.location:
            end = scf.YieldOp([])
        for op in list(body.operations)[:-1]:  # all but the scf.reduce terminator
            op.operation.move_before(end)
        body.arguments[0].replace_all_uses_with(loop.induction_variable)
        p.erase()
        done += 1
    return done


def _nowait_sole_loops(module: Any) -> int:
    """Note [no barrier before the join]: convert-scf-to-openmp gives each parallel loop its own
    omp.parallel holding one omp.wsloop, whose implicit end barrier (__kmpc_barrier) comes right
    before the region's join, which waits for every member anyway. The barrier adds nothing but
    its wait: src/kmp_pool.c spins, then yields the core in a loop, which on a loaded machine
    keeps taking the core from the very member it waits for (a GPT-2 tiny step at 2 threads:
    ~13800 sched_yield calls in 10 steps, eager's steps ~250). Such loops get `nowait`; a
    region with more in it keeps its barriers. Returns how many."""
    from mlir import ir

    loops: list[Any] = []

    def find(op: Any) -> Any:
        if op.name == "omp.wsloop":
            loops.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(find)
    done = 0
    for w in loops:
        par = w.parent
        if par is None or par.name != "omp.parallel" or len(par.regions[0].blocks) != 1:
            continue
        names = [o.operation.name for o in par.regions[0].blocks[0].operations]
        if names != ["omp.wsloop", "omp.terminator"] or "nowait" in w.attributes:
            continue
        w.attributes["nowait"] = ir.UnitAttr.get()
        done += 1
    return done


def _strided_copies_as_loops(module: Any) -> int:
    """memref.copy ops with a strided side become linalg.copy (loops, like every other op of
    the kernel); returns how many. LLVM lowering turns such a copy into a call of the runtime's
    memrefCopy, which neither the JIT nor a cached kernel library has. Bufferization leaves one
    where a fused slice_scatter inserts a value it could not compute in place (a slice of
    another value: LLaMA's rotary backward); contiguous copies stay memcpy."""
    from mlir import ir
    from mlir.dialects import linalg

    copies: list[Any] = []

    def find(op: Any) -> Any:
        if op.name == "memref.copy":
            copies.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(find)
    moved = 0
    for op in copies:
        src, dst = op.operands[0], op.operands[1]
        if not any(
            isinstance(ir.MemRefType(v.type).layout, ir.StridedLayoutAttr) for v in (src, dst)
        ):
            continue
        with ir.InsertionPoint(op), op.location:
            linalg.copy(src, outs=[dst])
        op.erase()
        moved += 1
    return moved


_SCALAR_ACCESS = {"affine.load", "affine.store", "memref.load", "memref.store"}


def _fold_unit_subviews(module: Any) -> int:
    """Loads and stores through a slice at offset 0 with unit strides (no rank change) read
    its base instead, at the same indices (Note [slices read through their base] in
    pipelines.py); returns how many accesses moved. Other users keep the slice."""
    subviews: list[Any] = []

    def find(op: Any) -> Any:
        from mlir import ir

        if op.name == "memref.subview":
            subviews.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(find)
    moved = 0
    for sv in subviews:
        a = sv.attributes
        if len(sv.operands) != 1:  # dynamic offsets, sizes or strides
            continue
        offs, strides = list(a["static_offsets"]), list(a["static_strides"])
        src, res = sv.operands[0], sv.results[0]
        if any(o != 0 for o in offs) or any(s != 1 for s in strides):
            continue
        if len(offs) != len(src.type.shape) or len(res.type.shape) != len(offs):
            continue
        for use in list(res.uses):
            owner = use.owner
            # the memref operand of a load is #0, of a store #1 (#0 is the value stored)
            if owner.name in _SCALAR_ACCESS and use.operand_number == (
                1 if owner.name.endswith("store") else 0
            ):
                owner.operands[use.operand_number] = src
                moved += 1
    return moved


_VIEW_OPS = {"memref.subview", "memref.expand_shape", "memref.collapse_shape"}
# ops a row nest may hold (anything else, a call or a copy, keeps the nest apart)
_NEST_OK = ("arith.", "math.")
_NEST_OPS = {"affine.for", "affine.yield", "affine.apply", "affine.load", "affine.store"}
_NEST_OPS |= {"memref.load", "memref.store"}
_HOISTABLE = {"memref.alloc", "memref.alloca", "arith.constant"}


def _mem_access(op: Any) -> tuple[Any, Any, bool] | None:
    """(memref, the value of its first index or None, is a write) of a load / store."""
    from mlir import ir

    name = op.name
    if name not in ("affine.load", "affine.store", "memref.load", "memref.store"):
        return None
    write = name.endswith("store")
    mem = op.operands[1 if write else 0]
    rest = list(op.operands)[2 if write else 1 :]
    if not ir.MemRefType(mem.type).shape:
        return mem, None, write
    if name.startswith("memref."):
        return mem, rest[0], write
    amap = ir.AffineMapAttr(op.attributes["map"]).value
    e = amap.results[0]
    if not isinstance(e, ir.AffineDimExpr):
        return mem, None, write
    return mem, rest[e.position], write


def _root(v: Any) -> Any:
    while getattr(v.owner, "name", None) in _VIEW_OPS:
        v = v.owner.operands[0]
    return v


def _nest_accesses(lp: Any) -> list[tuple[Any, Any, Any, bool]] | None:
    """(memref, its first index, the nest's row, is a write) of every load and store in the
    top-level affine.for `lp`, or None when the nest holds anything but loops, loads, stores
    and arithmetic."""
    from mlir import ir

    iv = lp.regions[0].blocks[0].arguments[0]
    out: list[tuple[Any, Any, Any, bool]] = []
    bad: list[str] = []

    def visit(op: Any) -> Any:
        nm = op.name
        if nm not in _NEST_OPS and not nm.startswith(_NEST_OK):
            bad.append(nm)
            return ir.WalkResult.INTERRUPT
        acc = _mem_access(op)
        if acc is not None:
            out.append((acc[0], acc[1], iv, acc[2]))
        return ir.WalkResult.ADVANCE

    for body_op in lp.regions[0].blocks[0].operations:
        body_op.operation.walk(visit)
    return None if bad else out


def _row_nest_ok(accesses: list[tuple[Any, Any, Any, bool]]) -> bool:
    """Whether nests with these accesses (_nest_accesses, over the same rows) may run row by
    row: every buffer one of them writes (any function argument, where one writes an argument:
    outputs may share an input's memory) is read and written only at the loop's own row,
    through one view of it, whose first dimension is the rows."""
    from mlir import ir

    written = [_root(m) for m, _, _, w in accesses if w]
    args_written = any(isinstance(r.owner, ir.Block) for r in written)
    seen_view: dict[str, Any] = {}
    for m, first, iv, _ in accesses:
        r = _root(m)
        if not (any(r == w for w in written) or (args_written and isinstance(r.owner, ir.Block))):
            continue
        if first is None or first != iv:
            return False
        key = r.get_name()
        if key in seen_view and seen_view[key] != m:
            return False
        seen_view[key] = m
    return True


def _loop_key(op: Any) -> str | None:
    """The bounds of a top-level affine.for with constant bounds, else None."""
    if op.name != "affine.for" or len(op.operands) != 0:
        return None
    a = op.attributes
    return f"{a['lowerBoundMap']} {a['upperBoundMap']} {a['step']}"


def _fuse_row_loops(module: Any) -> int:
    """Note [one row at a time]: a row group's linalg ops become one loop nest each over all
    rows (a max, then an exp sum, then the statistics), so every pass streams the whole input
    from memory; eager finishes a row (in cache) before the next. Consecutive top-level nests
    over the same rows whose every shared buffer is touched only at the loop's own row
    (_row_nest_ok) become one loop over the rows holding their bodies in order: each row's
    values are computed by the same operations in the same order as before, only rows
    interleave. The buffers they allocate between them move above the loop. Returns how many
    loops were merged away."""
    merged = 0
    for fn in module.body.operations:
        if fn.operation.name != "func.func":
            continue
        block = fn.regions[0].blocks[0]
        runs: list[tuple[list[Any], list[Any]]] = []
        run: list[Any] = []
        run_acc: list[tuple[Any, Any, Any, bool]] = []  # the accesses of the nests in run
        hoist: list[Any] = []
        pending: list[Any] = []
        key = None
        for op in list(block.operations):
            op = op.operation
            k = _loop_key(op)
            acc = _nest_accesses(op) if k is not None else None
            if acc is not None and run and k == key and _row_nest_ok(run_acc + acc):
                run.append(op)
                run_acc += acc
                hoist += pending
                pending = []
                continue
            if op.name in _HOISTABLE and run:
                pending.append(op)
                continue
            if len(run) > 1:
                runs.append((run, hoist))
            run, run_acc, hoist, pending, key = [], [], [], [], None
            if acc is not None and _row_nest_ok(acc):
                run, run_acc, key = [op], acc, k
        if len(run) > 1:
            runs.append((run, hoist))
        for loops, moved in runs:
            first = loops[0]
            for op in moved:
                op.move_before(first)
            body = first.regions[0].blocks[0]
            iv = body.arguments[0]
            term = list(body.operations)[-1]
            for lp in loops[1:]:
                lb = lp.regions[0].blocks[0]
                lb.arguments[0].replace_all_uses_with(iv)
                for op in list(lb.operations)[:-1]:
                    op.move_before(term)
                lp.erase()
                merged += 1
    return merged


def _fold_view_chain_loads(module: Any) -> int:
    """Loads through a chain of views (expand_shape, subview, collapse_shape) that ends where
    it began: offset 0, the rank and the strides of the contiguous buffer at the chain's root,
    no dimension larger than the root's. Such a load reads the root at the same indices (the
    same address); returns how many moved. LLaMA's loss reads its logits so: (B*T, Vp) viewed
    (B, T, Vp), sliced to the vocabulary's V columns, collapsed to (B*T, V) with row stride Vp;
    its max and exp-sum passes ran scalar (Note [slices read through their base] in
    pipelines.py, which _fold_unit_subviews handles for one subview). Loads only: a vector
    read past the view's last column stays inside the root's row, and nothing is written
    through the root."""
    from mlir import ir

    views: list[Any] = []

    def find(op: Any) -> Any:
        if op.name in _VIEW_OPS:
            views.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(find)
    moved = 0
    for op in views:
        res = op.results[0]
        root = op.operands[0]
        while getattr(root.owner, "name", None) in _VIEW_OPS:  # (a block argument: no name)
            root = root.owner.operands[0]
        try:
            vt, rt = ir.MemRefType(res.type), ir.MemRefType(root.type)
            (vs, vo), (rs, ro) = vt.get_strides_and_offset(), rt.get_strides_and_offset()
        except (ValueError, TypeError):
            continue
        if root == res or vo != 0 or ro != 0 or list(vs) != list(rs):
            continue
        vsh, rsh = list(vt.shape), list(rt.shape)
        if len(vsh) != len(rsh) or any(v < 0 or v > r for v, r in zip(vsh, rsh)):
            continue
        if list(rs) != list(_contig_strides(tuple(rsh))) or vt.element_type != rt.element_type:
            continue
        for use in list(res.uses):
            owner = use.owner
            if owner.name in ("affine.load", "memref.load") and use.operand_number == 0:
                owner.operands[0] = root
                moved += 1
    return moved


def _run_reporting(pm: Any, op: Any) -> None:
    """pm.run(op) for pipelines with affine-super-vectorize, which reports each loop it leaves
    scalar (a strided memref: 'NYI: non-trivial layout map') as an error diagnostic yet succeeds;
    the bindings then abort (an error captured but never raised). Here diagnostics go to a
    handler that keeps them, and a real failure raises with them."""
    ctx = op.context
    seen: list[str] = []

    def keep(d: Any) -> bool:
        seen.append(f"{d.location}: {d.message}")
        return True

    handler = ctx.attach_diagnostic_handler(keep)
    old = ctx.emit_error_diagnostics
    ctx.emit_error_diagnostics = True
    try:
        pm.run(op)
    except Exception as e:
        raise RuntimeError(f"{e}; diagnostics: {'; '.join(seen)[:4000]}") from e
    finally:
        ctx.emit_error_diagnostics = old
        handler.detach()


def _where(dump: Any) -> str:
    return f"dump in {dump.dir}" if dump else "set BLUTRAIN_COMPILE_DUMP=dir to keep the IR"


def compile_gpu_cache(graph: Graph, target: str = "cuda:0") -> str:
    """Compiles a graph's PTX into the disk cache without a GPU, under the key build() looks up
    for `target` (a GPU machine without the MLIR bindings then loads it: Note [cache hits
    without MLIR] in cache.py); returns the entry's folder. A group that cannot be lowered
    raises (build() would run its node eagerly, a partition this entry would not match)."""
    from . import cache
    from .lower import LoweringError

    ghash = graph.hash()  # (before ptx_for: decompose rewrites the graph in place)
    centry = cache.Entry(cache.key(graph.hash_full(), target, ""))
    if centry.path is None:
        raise CompileError("[compile_gpu_cache] the disk cache is off (BLUTRAIN_COMPILE_CACHE=0)")
    if centry.load("gpu.json") is not None:
        return str(centry.path)
    try:
        _, code = ptx_for(graph)
    except LoweringError as e:
        raise CompileError(f"[compile_gpu_cache] graph {ghash}: {e}") from e
    if code.unsupported:
        raise CompileError(f"[compile] graph {ghash}: stage gpu-host: {code.unsupported}")
    centry.store(
        "gpu.json",
        code.to_json().encode(),
        {"graph": ghash, "target": target, "unlowerable": []},
    )
    return str(centry.path)


_DLPACK = {  # dtype -> (DLPack type code, bits)
    "bool": (6, 8),
    "uint8": (1, 8),
    "int32": (0, 32),
    "int64": (0, 64),
    "float16": (2, 16),
    "bfloat16": (4, 16),
    "float32": (2, 32),
    "float64": (2, 64),
}

_MODE = {"highest": "fp32", "high": "tf32", "medium": "bf16"}


def _gemm_out_ok(graph: Graph, n: Node) -> bool:
    """GEMMs whose output blutrain.linalg can write into a planned buffer."""
    if n.op not in ("linear", "matmul"):
        return False
    a, b = graph.values[n.inputs[0]], graph.values[n.inputs[1]]
    if n.op == "linear":
        return len(b.shape) == 2 and len(a.shape) >= 2
    return len(a.shape) in (2, 3) and len(a.shape) == len(b.shape) and not n.attrs.get("bias")


def _gather_out_ok(graph: Graph, n: Node) -> bool:
    """Gathers blutrain.tensor writes into a planned buffer (index_select's out= form): a
    1-D index. (Gated to the CPU in session 45 while the compiled CUDA steps gave NaN; the
    cause was rowgen's, Note [views of register values], not this path.)"""
    if n.op != "index_select" or len(n.inputs) != 2:
        return False
    return len(graph.values[n.inputs[1]].shape) == 1


def _gather_into(n: Node, x: list[Any], out: Any) -> None:
    """A captured index_select (or embedding: its index rules) writing `out`."""
    with bt.no_grad():
        bt._tensor._index_select_out(
            x[0], int(n.attrs["dim"]), x[1], out, bool(n.attrs.get("embedding", False))
        )


# Note [GEMM plans]: blutrain.linalg's matmul plans a repeated signature only for torch
# operands; on blutrain tensors each call took its general path (views through DLPack, checks,
# a new descriptor): ~11 us a GEMM on the CPU above eager's bt.linear, 0.6 ms of LLaMA tiny's
# 6 ms compiled step (57 GEMMs). A program's GEMM runs the same signature every call (the
# guards fix shapes, dtypes and contiguity), so each node keeps the plan of its first call
# (linalg.matmul_plan) and reruns it on the new pointers while the operands' shapes and strides
# (checked each call, ~0.6 us) are unchanged; anything else makes a new plan. Same GEMM, same
# bits. On CUDA the plan runs on the stream current at each call.
def _gemm_into(n: Node, x: list[Any], out: Any, plans: dict | None = None) -> None:
    """A captured GEMM through blutrain.linalg, writing `out` (same precision as eager's)."""
    import blutrain.linalg as L

    a, b = x[0], x[1]
    mode = _MODE.get(bt.get_float32_matmul_precision(), "fp32") if a.dtype == bt.float32 else None
    dev = str(out.device)
    stream = (
        int(bt._tensor._cuda_current_stream(_device_index(dev))) if dev.startswith("cuda") else None
    )
    bias = None
    trans = bool(n.attrs.get("trans_b"))
    if n.op == "linear":
        bias = x[2] if len(x) > 2 and n.attrs.get("bias") else None
        a = a.reshape(-1, a.shape[-1])
        out = out.reshape(-1, out.shape[-1])
        trans = True
    if plans is None:
        L.matmul(a, b, transb=trans, bias=bias, out=out, mode=mode, stream=stream)
        return
    sig = (
        a.shape,
        a.stride(),
        b.shape,
        b.stride(),
        out.shape,
        out.stride(),
        None if bias is None else (bias.shape, bias.stride()),
        mode,
    )
    hit = plans.get(n.index)
    if hit is not None and hit[0] == sig:
        hit[1].run(a, b, out, None, bias, None, None, stream)
        return
    plan = L.matmul_plan(a, b, transb=trans, bias=bias, out=out, mode=mode, stream=stream)
    plans[n.index] = (sig, plan)


def _sig(graph: Graph, G: fusion.Group) -> tuple[list, list]:
    shapes = [graph.values[i].shape for i in G.inputs] + [graph.values[o].shape for o in G.outputs]
    return shapes, [_contig_strides(s) for s in shapes]


def _device_index(target: str) -> int:
    return int(target.split(":")[1]) if ":" in target else 0


def ptx_for(graph: Graph, dump: Any = None) -> Any:
    """PTX for sm_90 of every fused group of a graph (no GPU needed): backend_gpu.GpuCode."""
    from mlir import ir
    from mlir.passmanager import PassManager

    from . import backend_gpu
    from .decompose import decompose
    from .lower import Emitter

    graph = decompose(graph, gpu=True)
    part = fusion.partition(graph)
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.create()
        for G in part.groups:
            Emitter(graph, G.nodes, G.inputs, G.outputs, G.name).build(module)
        aliases = dedup_groups(module)  # Note [identical groups]
        recompute.duplicate(module)
        PassManager.parse(pipelines.FUSE).run(module.operation)
        PassManager.parse(pipelines.BUFFERIZE).run(module.operation)
        code = backend_gpu.compile_module(module, dump)
        for d, k in aliases.items():
            code.functions[d] = code.functions[k]
        return part, code


def _failing_node(graph: Graph, G: fusion.Group, em: Any) -> Node:
    """The first compute node of G whose outputs the emitter did not produce."""
    for n in G.compute_nodes():
        if any(o not in em.env for o in n.outputs):
            return n
    return G.compute_nodes()[-1]


def describe(graph: Graph, part: fusion.Partition) -> str:
    """Fusion groups with their nodes and the reason each ends (for the dump and the log)."""
    lines = []
    for s in part.steps:
        if isinstance(s, fusion.Group):
            ops = [n.op for n in s.compute_nodes()]
            lines.append(
                f"group {s.name} ({s.device}): {len(ops)} ops [{', '.join(ops)}]"
                + (f" (merged {s.merged})" if s.merged else "")
            )
            lines.append(f"  inputs  {['%' + str(i) for i in s.inputs]}")
            lines.append(f"  outputs {['%' + str(o) for o in s.outputs]}")
            lines.append(f"  boundary: {s.closed_by}")
        else:
            n = s.node
            lines.append(f"{s.kind} {n.op} (node {n.index}): {n}")
    return "\n".join(lines) + "\n"
