"""`compile(fn)`: capture on the first call, guard, reuse, recompile with a logged reason.

    step = blutrain.compiler.compile(train_step)      # train_step(x, y, lr) -> loss
    loss = step(x, y, lr)                             # captures, compiles, runs
    loss = step(x2, y2, lr2)                          # same shapes: reuses the program

Guards: every tensor argument's shape, dtype, device and contiguity, the type of every other
argument, the value of int / bool / str arguments (they may shape the program), the float32
matmul precision and grad mode. Python floats are *runtime scalars*: they enter the program as
0-d float32 tensors (fn sees a bt.Tensor), so a learning-rate schedule never recompiles; ints
named in `scalars=` (a step count) are runtime scalars too. A guard miss recompiles and logs which
guard changed; more than `max_recompiles` programs raise RecompileLimitError naming the changes.

`compile(fn, cuda_graph=True)` (CUDA only) replays a program from its third call on as one CUDA
graph (Note [compiled programs as CUDA graphs]).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import blutrain.tensor as bt

from . import program as P
from .graph import Graph, from_capture

log = logging.getLogger("blutrain.compiler")


class RecompileLimitError(RuntimeError):
    pass


def _describe(x: Any) -> Any:
    if isinstance(x, bt.Tensor):
        return ("tensor", tuple(x.shape), str(x.dtype), str(x.device), bool(x.is_contiguous()))
    if isinstance(x, bool) or isinstance(x, (int, str)) or x is None:
        return (type(x).__name__, x)
    if isinstance(x, float):
        return ("float",)
    raise TypeError(
        f"[compile] argument of type {type(x).__name__} is not supported (tensors, floats, "
        "ints, bools, strings)"
    )


def _guard_diff(old: tuple, new: tuple, names: Sequence[str]) -> str:
    """The first guard that changed, readably: `x: shape (4, 8) -> (3, 8)`."""
    fields = ("kind", "shape", "dtype", "device", "contiguous")
    for i, (a, b) in enumerate(zip(old, new)):
        if a == b:
            continue
        nm = names[i] if i < len(names) else f"#{i}"
        if a[0] == b[0] == "tensor":
            for f, x, y in zip(fields, a, b):
                if x != y:
                    return f"{nm}: {f} {x} -> {y}"
        return f"{nm}: {a[-1] if len(a) > 1 else a[0]} -> {b[-1] if len(b) > 1 else b[0]}"
    return f"argument count {len(old) - 2} -> {len(new) - 2}"


# Note [compiled programs as CUDA graphs]: a compiled step runs hundreds of program steps, each
# a few host-side lines and a launch (LLaMA small's training step: about 600); a CUDA graph
# replays them all with one launch. The program suits one: its buffers sit at fixed arena
# offsets, its scalars are device tensors filled before each call, and nothing in it
# synchronises the host. With cuda_graph=True the first GRAPH_WARMUP calls run as usual (the
# arena, GEMM plans and workspaces come into being), the next is captured into
# blutrain.tensor's CUDA graph (its fresh tensors from the graph's private pool) and replayed,
# and later calls replay it. Arguments the program writes or gives a .grad must be the same
# tensors at every call (a different one raises); others (a batch) are copied into the graph's
# own buffers first. As torch.compile's "reduce-overhead" mode: the returned tensors and the
# .grads are the graph's and the next call overwrites them. A program with random ops stays
# ungraphed (a replay would draw the same numbers), and a capture that fails (an op that
# synchronises the host) is logged and the program runs as before.
GRAPH_WARMUP = 2  # calls run before the capture
RANDOM_OPS = ("random", "dropout")


class Compiled:
    """One compiled program plus how to bind a call's arguments to its inputs."""

    def __init__(
        self,
        prog: P.Program,
        graph: Graph,
        bind: list[tuple[str, Any]],
        outputs: list[int],
        out_struct: Any,
        grads: list[tuple[Any, int]],
        mutations: list[tuple[Any, int]],
    ) -> None:
        self.prog, self.graph, self.bind = prog, graph, bind
        self.outputs, self.out_struct = outputs, out_struct
        self.grads, self.mutations = grads, mutations
        self.grad_state: tuple[bool, ...] = ()  # set by the caller: leaves with a .grad
        # Note [compiled programs as CUDA graphs]
        self.use_graph = False
        self.calls = 0
        self.cuda_graph: Any = None
        self.graph_out: Any = None
        self.graph_grads: list[tuple[int, Any]] = []
        self.graph_copies: list[tuple[int, Any]] = []  # (input position, the graph's buffer)
        self.graph_fixed: list[tuple[int, int]] = []  # (input position, data_ptr at capture)
        # values the caller keeps are not planned into the arena (it is reused every call)
        prog.prepare(set(outputs) | {v for _, v in grads} | {v for _, v in mutations})

    def current_grad_state(self, args: Sequence[Any]) -> tuple[bool, ...]:
        ins = self.inputs(args)
        return tuple(ins[k].grad is not None for k, _ in self.grads)

    def inputs(self, args: Sequence[Any]) -> list[Any]:
        ins = []
        for kind, ref in self.bind:
            if kind == "arg":
                ins.append(args[ref])
            elif kind == "scalar":
                pos, t = ref
                t.fill_(float(args[pos]))
                ins.append(t)
            else:  # a tensor the function reads from outside (a parameter)
                ins.append(ref)
        return ins

    def __call__(self, args: Sequence[Any]) -> Any:
        if not self.use_graph:
            return self._run(self.inputs(args))
        self.calls += 1
        if self.cuda_graph is not None:
            return self._replay(args)
        if self.calls <= GRAPH_WARMUP:
            return self._run(self.inputs(args))
        return self._capture(args)

    def enable_cuda_graph(self, name: str) -> None:
        random = sorted({n.op for n in self.graph.nodes if n.op in RANDOM_OPS})
        if random:
            log.warning(
                "[compile] %s: no CUDA graph: the program draws random numbers (%s), which a "
                "replay would repeat",
                name,
                ", ".join(random),
            )
            return
        self.use_graph, self.name = True, name

    def _capture(self, args: Sequence[Any]) -> Any:
        ins = self.inputs(args)
        kept = {k for k, _ in self.grads} | {k for k, _ in self.mutations}
        copies, fixed = [], []
        for pos, (kind, _) in enumerate(self.bind):
            if kind != "arg" or not isinstance(ins[pos], bt.Tensor):
                continue
            if pos in kept:
                fixed.append((pos, ins[pos].data_ptr()))
            else:
                buf = ins[pos].clone()  # (eagerly, before the capture)
                copies.append((pos, buf))
                ins[pos] = buf
        graph = bt.cuda.CUDAGraph()
        try:
            with bt.cuda.graph(graph):
                out = self._run(ins)
        except Exception as e:  # noqa: BLE001 (any failure: run without a graph)
            log.warning(
                "[compile] %s: CUDA graph capture failed (%s): runs without one", self.name, e
            )
            self.use_graph = False
            for slots in self.prog.returned.values():  # (any taken from the discarded pool)
                slots.clear()
            return self._run(self.inputs(args))
        self.cuda_graph, self.graph_out = graph, out
        self.graph_copies, self.graph_fixed = copies, fixed
        self.graph_grads = [(k, ins[k].grad) for k, _ in self.grads]
        graph.replay()  # the capture recorded the call; this runs it
        return out

    def _replay(self, args: Sequence[Any]) -> Any:
        ins = self.inputs(args)  # (fills the runtime scalars)
        for pos, ptr in self.graph_fixed:
            if ins[pos].data_ptr() != ptr:
                raise RuntimeError(
                    f"[compile] {self.name}: argument {pos} is not the tensor the CUDA graph was "
                    "captured with; the program writes it or sets its .grad, so pass the same "
                    "tensor every call (or compile without cuda_graph)"
                )
        with bt.no_grad():
            for pos, buf in self.graph_copies:
                buf.copy_(ins[pos])
        self.cuda_graph.replay()
        for k, t in self.graph_grads:
            ins[k].grad = t
        return self.graph_out

    def _run(self, ins: list[Any]) -> Any:
        env = self.prog.run(ins)
        with bt.no_grad():
            for k, v in self.grads:  # each leaf's .grad as the program leaves it
                ins[k].grad = None if v < 0 else self.prog.value(env, v)
            for k, v in self.mutations:  # parameters, optimizer moments: written in place
                new = self.prog.value(env, v)
                if not _same(new, ins[k]):
                    ins[k].copy_(new)
        outs = [self.prog.value(env, o) for o in self.outputs]
        if self.out_struct == "single":
            return outs[0]
        if self.out_struct == "none":
            return None
        return tuple(outs)


class CompiledFunction:
    def __init__(
        self,
        fn: Callable[..., Any],
        target: str | None,
        max_recompiles: int,
        scalars: Sequence[str | int],
        cuda_graph: bool = False,
    ) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.cuda_graph = cuda_graph
        self.target = target
        self.max_recompiles = max_recompiles
        self.scalars = set(scalars)
        self.programs: dict[tuple, Compiled] = {}
        self.recompiles: list[str] = []
        self.last_key: tuple | None = None
        try:
            import inspect

            self.argnames = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            self.argnames = []

    def _is_scalar(self, i: int, x: Any) -> bool:
        if isinstance(x, float):
            return True
        nm = self.argnames[i] if i < len(self.argnames) else None
        return (
            isinstance(x, int)
            and not isinstance(x, bool)
            and (i in self.scalars or (nm is not None and nm in self.scalars))
        )

    def key(self, args: Sequence[Any]) -> tuple:
        k = []
        for i, x in enumerate(args):
            k.append(("scalar",) if self._is_scalar(i, x) else _describe(x))
        k.append(("matmul_precision", bt.get_float32_matmul_precision()))
        k.append(("attention_precision", bt.get_float32_attention_precision()))
        k.append(("grad_enabled", bt.is_grad_enabled()))
        return tuple(k)

    def __call__(self, *args: Any) -> Any:
        base = self.key(args)
        c = None
        why = ""
        for (k, gs), cand in self.programs.items():
            if k != base:
                continue
            if cand.current_grad_state(args) == gs:
                c = cand
                break
            why = "a leaf's .grad changed between None and a tensor (accumulation differs)"
        if c is None:
            if self.programs:
                names = self.argnames + ["matmul precision", "grad mode"]
                prev = self.last_key or next(iter(self.programs))[0]
                why = why or _guard_diff(prev, base, names)
                self.recompiles.append(why)
                if len(self.programs) >= self.max_recompiles:
                    raise RecompileLimitError(
                        f"[compile] {self.__name__}: {len(self.programs)} programs compiled, the "
                        f"limit (max_recompiles={self.max_recompiles}); changes: "
                        + "; ".join(self.recompiles)
                        + ". Keep shapes fixed (pad batches) or raise max_recompiles."
                    )
                log.warning("[compile] recompiling %s: %s", self.__name__, why)
            c = self._compile(args)
            c.grad_state = c.current_grad_state(args)  # as at the capture's start
            self.programs[(base, c.grad_state)] = c
        key = base
        self.last_key = key
        return c(args)

    def _compile(self, args: Sequence[Any]) -> Compiled:
        # runtime scalars: 0-d float32 tensors the program reads
        call_args = list(args)
        scalar_t: dict[int, Any] = {}
        dev = next((str(a.device) for a in args if isinstance(a, bt.Tensor)), "cpu")
        for i, x in enumerate(args):
            if self._is_scalar(i, x):
                t = bt.full((), float(x), dtype=bt.float32, device=dev)
                scalar_t[i] = t
                call_args[i] = t
        tagged = []
        if not hasattr(bt.Graph, "input_tensors"):
            for i, a in enumerate(call_args):
                if isinstance(a, bt.Tensor):
                    tagged.append((a, a.name))
                    a.name = f"__btc_arg{i}"
        # the capture advances the random generator as a run would: put it back, so the first
        # run draws where eager would have
        rng_state = bt._tensor._get_rng_state()
        try:
            cap = bt.capture()
            cg = cap.__enter__()
            try:
                res = self.fn(*call_args)
            except BaseException:
                cap.__exit__(None, None, None)
                raise
        finally:
            for a, nm in tagged:
                a.name = nm
        try:
            if res is None:
                outs, struct = [], "none"
            elif isinstance(res, bt.Tensor):
                outs, struct = [res], "single"
            elif isinstance(res, (tuple, list)) and all(isinstance(r, bt.Tensor) for r in res):
                outs, struct = list(res), "tuple"
            else:
                raise TypeError(f"[compile] {self.__name__} must return tensors, got {type(res)}")
            for o in outs:
                cg.mark_output(o)
        finally:
            cap.__exit__(None, None, None)
            bt._tensor._set_rng_state(*rng_state)
        g = from_capture(cg)
        bind = self._bind(cg, g, args, call_args, scalar_t)
        grads, muts = self._effects(cg, g)
        target = self.target or ("cuda" if dev.startswith("cuda") else "cpu")
        prog = P.build(g, target, dump=_dump_for(g))
        log.info(
            "[compile] %s: graph %s, %d nodes -> %d fused kernels, %d library calls, "
            "%d eager, %.2fs",
            self.__name__,
            g.hash(),
            prog.stats.nodes,
            prog.stats.groups,
            prog.stats.library_calls,
            prog.stats.eager_steps,
            prog.stats.compile_s,
        )
        c = Compiled(prog, g, bind, list(g.outputs), struct, grads, muts)
        if self.cuda_graph and target.startswith("cuda"):
            c.enable_cuda_graph(self.__name__)
        return c

    def _bind(
        self, cg: Any, g: Graph, args: Sequence[Any], call_args: list[Any], scalar_t: dict[int, Any]
    ) -> list[tuple[str, Any]]:
        """For each graph input: an argument position, a runtime scalar, or a fixed tensor."""
        tensors = getattr(cg, "input_tensors", None)
        if callable(tensors):
            tensors = tensors()
        if tensors is not None and len(tensors) != len(g.inputs):
            tensors = None
        bind: list[tuple[str, Any]] = []
        for k, vid in enumerate(g.inputs):
            found = None
            if tensors is not None:
                t = tensors[k]
                found = next(
                    (
                        i
                        for i, a in enumerate(call_args)
                        if isinstance(a, bt.Tensor) and _same(a, t)
                    ),
                    None,
                )
            else:  # a capture that cannot name its inputs: arguments were tagged by name
                t = None
                nm = g.values[vid].name
                if nm.startswith("__btc_arg"):
                    found = int(nm[len("__btc_arg") :])
                else:
                    v = g.values[vid]
                    raise RuntimeError(
                        f"[compile] {self.__name__} reads a tensor that is not an argument "
                        f"(%{vid}: {v.dtype}{tuple(v.shape)}); this blutrain.tensor cannot bind "
                        "it: pass it as an argument"
                    )
            if found is not None:
                bind.append(
                    ("scalar", (found, scalar_t[found])) if found in scalar_t else ("arg", found)
                )
            else:
                bind.append(("tensor", t))
        return bind

    def _effects(self, cg: Any, g: Graph) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(input position, value) of every leaf's final .grad and every written input."""
        pos = {vid: k for k, vid in enumerate(g.inputs)}
        grads = [(pos[a], int(b)) for a, b in g.grads if a in pos]
        muts = [(pos[a], int(b)) for a, b in g.mutations if a in pos]
        if not hasattr(cg, "grads"):  # older capture: accumulate_grad nodes without outputs
            grads += [
                (pos[n.inputs[0]], n.inputs[1])
                for n in g.nodes
                if n.op == "accumulate_grad" and n.inputs[0] in pos
            ]
        return grads, muts


def _same(a: Any, b: Any) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and tuple(a.shape) == tuple(b.shape)
        and (tuple(a.stride()) == tuple(b.stride()))
    )


def _dump_for(g: Graph) -> Any:
    d = os.environ.get("BLUTRAIN_COMPILE_DUMP")
    if not d:
        return None
    from .dump import Dump

    return Dump(os.path.join(d, g.hash()))


def compile(
    fn: Any = None,
    *,
    target: str | None = None,
    max_recompiles: int = 8,
    scalars: Sequence[str | int] = (),
    cuda_graph: bool = False,
) -> Any:
    """Compile `fn` (or a Module's forward) with guards; usable as a decorator. cuda_graph: on
    CUDA, replay the program as one CUDA graph from its third call on (Note [compiled programs
    as CUDA graphs]: returned tensors are overwritten by the next call)."""
    if fn is None:
        return lambda f: compile(
            f,
            target=target,
            max_recompiles=max_recompiles,
            scalars=scalars,
            cuda_graph=cuda_graph,
        )
    if isinstance(fn, bt.nn.Module):
        mod = fn

        def forward(*a: Any) -> Any:
            return mod(*a)

        forward.__name__ = type(mod).__name__
        return CompiledFunction(forward, target, max_recompiles, scalars, cuda_graph)
    return CompiledFunction(fn, target, max_recompiles, scalars, cuda_graph)
