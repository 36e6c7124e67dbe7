"""Fusion: the captured nodes partitioned into fused groups and eager steps.

Nodes are walked in program order. A lowerable node joins the open group(s) that produce its
inputs (producer-consumer fusion: elementwise chains, broadcasts, reductions and the norms and
losses built from them); view ops join whichever group reads them and cost nothing (index maps).
A group closes, i.e. becomes a kernel, when something that is not fused reads one of its values
(a GEMM or attention call, a gather, an eager fallback), when it reaches the size cap, or at the
end of the program; each boundary is recorded with its reason (BLUTRAIN_COMPILE_DUMP writes them).
Values that stay inside a group are never written to memory: the group's function returns only
the values read outside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import eager
from .graph import Graph, Node
from .opsets import CPU_LOWERABLE, LOWERABLE

MAX_GROUP_NODES = 256  # nodes (views included) per group: bounds MLIR compile time per kernel
# Old captures (before the graph contract) record accumulate_grad without an output: a side
# effect the caller applies. Newer ones give it an output value (the leaf's new .grad): lowered.
SIDE_EFFECTS = {"accumulate_grad"}
CONSTANTS = {"full", "arange"}  # free inside any kernel: never a reason for a boundary


@dataclass
class Group:
    id: int
    device: str
    nodes: list[Node] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    closed_by: str = ""
    merged: list[int] = field(default_factory=list)  # ids of groups merged into this one
    open: bool = True

    @property
    def name(self) -> str:
        return f"k{self.id}"

    def compute_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.op not in eager.VIEW_OPS]


@dataclass
class EagerStep:
    node: Node
    kind: str  # "library" (GEMM / attention by design), "eager" (gather, random...), "fallback"
    reason: str = ""


@dataclass
class Partition:
    steps: list[Group | EagerStep]
    groups: list[Group]
    fallbacks: list[Node]
    side_effects: list[Node]


def _scalar_group(G: Group, g: Graph) -> bool:
    """A group whose outputs are all scalars (0-d or one element)."""
    outs = [o for m in G.compute_nodes() for o in m.outputs]
    return bool(outs) and all(g.values[o].numel <= 1 for o in outs)


def lowerable(n: Node, cpu: bool = False) -> bool:
    return (n.op in LOWERABLE or (cpu and n.op in CPU_LOWERABLE)) and n.op not in eager.LIBRARY_OPS


def partition(g: Graph, unlowerable: set[int] | None = None, cpu: bool = False) -> Partition:
    """unlowerable: node indices whose lowering failed (they become eager fallbacks). cpu: the
    target is the CPU (CPU_LOWERABLE ops fuse too)."""
    bad = unlowerable or set()
    prod = g.producer()
    steps: list[Group | EagerStep] = []
    groups: list[Group] = []
    group_of: dict[int, Group] = {}  # non-view value -> its group
    fallbacks: list[Node] = []
    side: list[Node] = []

    def chain(v: int) -> tuple[int, list[Node]]:
        """The non-view base of v and the view nodes from it to v (in order)."""
        views: list[Node] = []
        while v in prod and prod[v].op in eager.VIEW_OPS:
            views.append(prod[v])
            v = prod[v].inputs[0]
        return v, views[::-1]

    def close(G: Group, why: str) -> None:
        if G.open:
            G.open = False
            G.closed_by = why
            steps.append(G)

    for n in g.nodes:
        if n.op in eager.VIEW_OPS:
            continue
        if n.op in SIDE_EFFECTS and not n.outputs:
            for i in n.inputs:
                b, _ = chain(i)
                G = group_of.get(b)
                if G is not None:
                    close(G, f"%{i} is a gradient written to a leaf's .grad")
            side.append(n)
            continue
        dev = g.values[n.outputs[0]].device if n.outputs else "cpu"
        if lowerable(n, cpu) and n.index not in bad:
            deps: list[Group] = []
            views: list[Node] = []
            for i in n.inputs:
                if i < 0:
                    continue
                b, vs = chain(i)
                views += vs
                G = group_of.get(b)
                if G is None or not G.open or G in deps:
                    continue
                if G.device != dev:
                    close(G, f"%{b} moves from {G.device} to {dev}")
                elif (
                    g.values[b].numel <= 1
                    and not all(m.op in CONSTANTS for m in G.compute_nodes())
                    and not (_scalar_group(G, g) and all(g.values[o].numel <= 1 for o in n.outputs))
                ):
                    # a scalar edge (a clip coefficient, AdamW's step size, one tensor's sum
                    # of squares) does not tie two kernels into one: the scalar is computed
                    # once, not recomputed per element, and the groups stay small
                    close(G, f"%{b} is a scalar read by {n.op} (node {n.index})")
                elif len(G.nodes) + len(vs) + 1 > MAX_GROUP_NODES:
                    close(G, f"size cap of {MAX_GROUP_NODES} nodes reached before {n.op}")
                else:
                    deps.append(G)
            if deps:
                G = deps[0]
                for other in deps[1:]:  # two open producers: one kernel
                    G.nodes += other.nodes
                    G.merged.append(other.id)
                    other.open = False
                    groups.remove(other)
                    for v, gg in list(group_of.items()):
                        if gg is other:
                            group_of[v] = G
                G.nodes.sort(key=lambda m: m.index)
            else:
                G = Group(len(groups) and max(x.id for x in groups) + 1, dev)
                groups.append(G)
            for vnode in views:
                if vnode not in G.nodes:
                    G.nodes.append(vnode)
            G.nodes.append(n)
            for o in n.outputs:
                group_of[o] = G
            continue
        # not fused: close the groups it reads, then run it eagerly
        if n.op in eager.LIBRARY_OPS or n.op in eager.ATTENTION_OPS:
            kind = "library"
        elif n.op in eager.EAGER_BY_DESIGN:
            kind = "eager"
        else:  # an op the compiler does not lower: blutrain.tensor's replay runs it
            kind = "fallback"
        if n.index in bad:
            kind = "fallback"
        for i in n.inputs:
            if i < 0:
                continue
            b, _ = chain(i)
            G = group_of.get(b)
            if G is not None and G.open:
                close(G, f"{n.op} (node {n.index}, {kind}) reads %{b}")
        steps.append(EagerStep(n, kind))
        if kind == "fallback":
            fallbacks.append(n)
    for G in groups:
        close(G, "end of the program")
    # group interfaces
    used_outside: dict[int, bool] = {}
    for st in steps:
        nodes = st.nodes if isinstance(st, Group) else [st.node]
        for n in nodes:
            for i in n.inputs:
                if i < 0:
                    continue
                b, _ = chain(i)
                if isinstance(st, Group) and group_of.get(b) is st:
                    continue
                used_outside[b] = True
    for n in side:
        for i in n.inputs:
            used_outside[chain(i)[0]] = True
    for o in g.live_out():
        used_outside[chain(o)[0]] = True
    for G in groups:
        G.nodes.sort(key=lambda m: m.index)
        produced = {o for n in G.nodes for o in n.outputs}
        ins: list[int] = []
        for n in G.nodes:
            for i in n.inputs:
                if i >= 0 and i not in produced and i not in ins:
                    ins.append(i)
        G.inputs = ins
        G.outputs = [o for n in G.compute_nodes() for o in n.outputs if used_outside.get(o)]
    groups = [G for G in groups if G.outputs]  # a group nothing reads is dead code
    steps = [s for s in steps if not isinstance(s, Group) or s in groups]
    return Partition(steps, groups, fallbacks, side)
