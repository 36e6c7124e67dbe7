"""The compiler's view of a captured program: values, nodes, a canonical JSON form and a hash.

A `Graph` is what every later stage reads. It is built from blutrain.tensor's capture
(`from_capture`) and can be written as versioned JSON (`to_json`) and read back (`from_json`).
The hash is a SHA-256 of the canonical JSON (sorted keys, floats as exact hex, no names), so
the same program gives the same hash in another process on another machine.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

FORMAT_VERSION = 1

DTYPES = ("bool", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64")
ITEMSIZE = {
    "bool": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
}


def dtype_name(dt: Any) -> str:
    """'float32' for bt.float32, a string, or anything whose str ends with the name."""
    s = str(dt)
    s = s.rsplit(".", 1)[-1]
    if s not in DTYPES:
        raise ValueError(f"[compile] unknown dtype {dt!r}")
    return s


@dataclass
class Value:
    id: int
    shape: tuple[int, ...]
    dtype: str
    device: str = "cpu"
    name: str = ""
    is_input: bool = False
    requires_grad: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


@dataclass
class Node:
    op: str
    attrs: dict[str, Any]
    inputs: list[int]  # value ids; -1 for an absent optional input
    outputs: list[int]
    index: int = -1  # position in Graph.nodes
    raw: dict[str, Any] | None = None  # the capture's own node (bt.Graph.to_dict()), if any

    def __str__(self) -> str:
        outs = ", ".join(f"%{o}" for o in self.outputs)
        ins = ", ".join("none" if i < 0 else f"%{i}" for i in self.inputs)
        at = ", ".join(f"{k}={v!r}" for k, v in sorted(self.attrs.items()))
        return f"{outs + ' = ' if outs else ''}{self.op}({ins}){' {' + at + '}' if at else ''}"


@dataclass
class Graph:
    values: dict[int, Value] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    # values the caller reads besides `outputs`: the final value of every input the program
    # writes (parameters, optimizer moments) and every leaf's final .grad (capture's tables)
    mutations: list[tuple[int, int]] = field(default_factory=list)
    grads: list[tuple[int, int]] = field(default_factory=list)
    # the capture's document (bt.Graph.to_dict()): values' strides and storage, numerics, rng;
    # what eager.run needs to replay a node through blutrain.tensor's own interpreter
    raw: dict[str, Any] | None = None

    def live_out(self) -> list[int]:
        return (
            list(self.outputs)
            + [v for _, v in self.mutations]
            + [v for _, v in self.grads if v >= 0]
        )

    def producer(self) -> dict[int, Node]:
        return {o: n for n in self.nodes for o in n.outputs}

    def users(self) -> dict[int, list[Node]]:
        u: dict[int, list[Node]] = {v: [] for v in self.values}
        for n in self.nodes:
            for i in n.inputs:
                if i >= 0:
                    u[i].append(n)
        return u

    def reindex(self) -> None:
        for i, n in enumerate(self.nodes):
            n.index = i

    # ---- serialised form --------------------------------------------------------------------
    def to_dict(self, names: bool = True) -> dict[str, Any]:
        return {
            "format": "blutrain-compiler-graph",
            "version": FORMAT_VERSION,
            "values": [
                {
                    "id": v.id,
                    "shape": list(v.shape),
                    "dtype": v.dtype,
                    "device": v.device,
                    **({"name": v.name} if names and v.name else {}),
                    "is_input": v.is_input,
                    "requires_grad": v.requires_grad,
                }
                for v in sorted(self.values.values(), key=lambda v: v.id)
            ],
            "nodes": [
                {
                    "op": n.op,
                    "attrs": {k: _canon(a) for k, a in sorted(n.attrs.items())},
                    "inputs": n.inputs,
                    "outputs": n.outputs,
                }
                for n in self.nodes
            ],
            "inputs": self.inputs,
            "outputs": self.outputs,
            "mutations": [list(m) for m in self.mutations],
            "grads": [list(x) for x in self.grads],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1)

    @staticmethod
    def from_json(text: str) -> Graph:
        d = json.loads(text)
        if d.get("format") != "blutrain-compiler-graph" or d.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"[compile] not a version-{FORMAT_VERSION} graph: format {d.get('format')!r}, "
                f"version {d.get('version')!r}"
            )
        g = Graph()
        for v in d["values"]:
            g.values[v["id"]] = Value(
                v["id"],
                tuple(v["shape"]),
                v["dtype"],
                v["device"],
                v.get("name", ""),
                v["is_input"],
                v["requires_grad"],
            )
        for n in d["nodes"]:
            attrs = {k: _uncanon(a) for k, a in n["attrs"].items()}
            g.nodes.append(Node(n["op"], attrs, list(n["inputs"]), list(n["outputs"])))
        g.inputs, g.outputs = list(d["inputs"]), list(d["outputs"])
        g.mutations = [(int(a), int(b)) for a, b in d.get("mutations", [])]
        g.grads = [(int(a), int(b)) for a, b in d.get("grads", [])]
        g.reindex()
        return g

    def hash_full(self) -> str:
        """SHA-256 (hex) of the canonical form without names."""
        text = json.dumps(self.to_dict(names=False), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def hash(self) -> str:
        """The first 16 hex digits of hash_full() (names in logs, dumps)."""
        return self.hash_full()[:16]

    def __str__(self) -> str:
        def vs(i: int) -> str:
            v = self.values[i]
            return f"%{i}:{v.dtype}{tuple(v.shape)}"

        lines = ["graph(" + ", ".join(vs(i) for i in self.inputs) + ") {"]
        for n in self.nodes:
            outs = ", ".join(vs(o) for o in n.outputs)
            lines.append("  " + (outs + " = " if outs else "") + str(n).split(" = ", 1)[-1])
        lines.append("  return " + ", ".join(f"%{o}" for o in self.outputs))
        lines.append("}")
        return "\n".join(lines)


def _canon(a: Any) -> Any:
    """Attributes in JSON: floats exactly (hex), tuples as lists, dtypes by name."""
    if isinstance(a, bool) or a is None or isinstance(a, (int, str)):
        return a
    if isinstance(a, float):
        return {"f": a.hex()}
    if isinstance(a, (tuple, list)):
        return [_canon(x) for x in a]
    return {"s": str(a)}


def _uncanon(a: Any) -> Any:
    if isinstance(a, dict) and "f" in a:
        return float.fromhex(a["f"])
    if isinstance(a, dict) and "s" in a:
        return a["s"]
    if isinstance(a, list):
        return tuple(_uncanon(x) for x in a)
    return a


def from_capture(cg: Any) -> Graph:
    """A Graph from a blutrain.tensor capture (`bt.capture()`'s graph object)."""
    g = Graph()
    for v in cg.values:
        g.values[v["id"]] = Value(
            int(v["id"]),
            tuple(int(s) for s in v["shape"]),
            dtype_name(v["dtype"]),
            str(v["device"]),
            str(v.get("name", "")),
            bool(v["is_input"]),
            bool(v.get("requires_grad", False)),
        )
    raw = cg.to_dict() if hasattr(cg, "to_dict") else None
    g.raw = raw
    for k, n in enumerate(cg.nodes):
        attrs = {a: (tuple(v) if isinstance(v, list) else v) for a, v in dict(n["attrs"]).items()}
        ins, outs = [int(i) for i in n["inputs"]], [int(o) for o in n["outputs"]]
        g.nodes.append(Node(str(n["op"]), attrs, ins, outs, -1, raw["nodes"][k] if raw else None))
    g.inputs = [int(i) for i in cg.inputs]
    g.outputs = [int(o) for o in cg.outputs]
    g.mutations = [(int(a), int(b)) for a, b in getattr(cg, "mutations", []) or []]
    g.grads = [(int(a), int(b)) for a, b in getattr(cg, "grads", []) or []]
    g.reindex()
    return g
