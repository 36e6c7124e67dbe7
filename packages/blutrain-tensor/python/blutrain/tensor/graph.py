"""Captured graphs as a contract: the serialized form, a content hash, a loader, replay.

    with bt.capture() as g:              # records, runs nothing (symbolic tensors)
        loss = model(x, y)[1]
        loss.backward()
        g.mark_output(loss)
    s = g.to_json()                      # versioned JSON (docs/graph_format.md)
    g.hash()                             # sha256 of the program: the same in any process
    h = bt.load_graph(s)                 # the loader: checked against the op schemas
    (loss,) = h.replay(g.input_tensors)  # eager kernels: eager's bits

The format is described in ``packages/blutrain-tensor/docs/graph_format.md``; ``op_schemas()``
lists every op with its attributes and their types.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from . import _tensor as _C

FORMAT = "blutrain.graph"
SCHEMA_VERSION: int = _C.GRAPH_SCHEMA_VERSION

_SCHEMAS: dict[str, dict[str, Any]] | None = None


def op_schemas() -> dict[str, dict[str, Any]]:
    """op -> {"primitive", "attrs": {name: type}, "numerics", "view", "writes_inputs",
    "replayable"}: every op a capture can record (types: int, float, bool, str, ints, floats)."""
    global _SCHEMAS
    if _SCHEMAS is None:
        _SCHEMAS = {s["op"]: s for s in _C._op_schemas()}
    return {k: dict(v) for k, v in _SCHEMAS.items()}


def _schema(op: str) -> dict[str, Any]:
    op_schemas()
    assert _SCHEMAS is not None
    s = _SCHEMAS.get(op)
    if s is None:
        raise ValueError(f"[load_graph] unknown op {op!r} (no schema entry)")
    return s


# Floats are JSON numbers written by repr (they read back to the same double); the three
# values JSON has no number for are the strings "inf", "-inf" and "nan".
def _enc_float(x: float) -> float | str:
    return x if math.isfinite(x) else repr(float(x))


def _dec_float(x: Any, where: str) -> Any:
    if isinstance(x, str):
        if x not in ("inf", "-inf", "nan"):
            raise ValueError(f"[load_graph] {where}: {x!r} is not a float")
        return float(x)
    return x


def _enc_attrs(attrs: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in attrs.items():
        if isinstance(v, float):
            out[k] = _enc_float(v)
        elif isinstance(v, tuple):
            out[k] = [_enc_float(x) if isinstance(x, float) else x for x in v]
        else:
            out[k] = v
    return out


def _dec_attrs(op: str, attrs: Mapping[str, Any]) -> dict[str, Any]:
    types = _schema(op)["attrs"]
    out: dict[str, Any] = {}
    for k, v in attrs.items():
        t = types.get(k)
        if t == "float" or (t == "scalar" and not isinstance(v, int)):
            v = _dec_float(v, f"{op}.{k}")
        elif t == "floats" and isinstance(v, list):
            v = [_dec_float(x, f"{op}.{k}") for x in v]
        out[k] = v
    return out


class Graph(_C.Graph):
    """A captured program (see the module docstring and docs/graph_format.md)."""

    def __init__(self) -> None:  # (a Python signature: a bad call's error names Graph)
        super().__init__()

    # -- the serialized form ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The graph as JSON-ready Python data (the format of docs/graph_format.md)."""
        values = [
            {
                "id": v["id"],
                "shape": list(v["shape"]),
                "strides": list(v["strides"]),
                "offset": v["offset"],
                "dtype": v["dtype"].name,
                "device": v["device"],
                "name": v["name"],
                "input": v["is_input"],
                "requires_grad": v["requires_grad"],
                "storage": v["storage"],
            }
            for v in self.values
        ]
        nodes = [
            {
                "op": n["op"],
                "attrs": _enc_attrs(n["attrs"]),
                "inputs": list(n["inputs"]),
                "outputs": list(n["outputs"]),
                "mutates": list(n["mutates"]),
                "numerics": dict(n["numerics"]),
            }
            for n in self.nodes
        ]
        return {
            "format": FORMAT,
            "schema_version": SCHEMA_VERSION,
            "numerics": dict(self.numerics),
            "rng": dict(self.rng),
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "mutations": [list(m) for m in self.mutations],
            "grads": [list(g) for g in self.grads],
            "values": values,
            "nodes": nodes,
        }

    def to_json(self, indent: int | None = None) -> str:
        """The graph as versioned JSON text (exact: every float reads back to the same bits)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def save(self, path: str | os.PathLike) -> None:
        """Writes to_json() to `path` atomically (a temporary file renamed into place)."""
        path = os.fspath(path)
        d = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".graph-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def hash(self) -> str:
        """sha256 (hex) of the program: the same graph gives the same hash in any process and
        on any machine. It covers everything in to_dict() except what names or places the
        program rather than defines it: value names, the CUDA device index, and where the
        random generator stood (random ops' offsets count from the capture's start, and a
        seed equal to the generator's at the start is hashed as such)."""
        d = self.to_dict()
        rng = d.pop("rng")
        seed, begin = rng["seed"], rng["offset_begin"]
        d["rng_draws"] = rng["offset_end"] - begin
        for v in d["values"]:
            v["name"] = ""
            v["device"] = v["device"].split(":")[0]
        for n in d["nodes"]:
            if n["op"] in ("random", "dropout"):
                a = n["attrs"]
                a["offset"] -= begin
                if a["seed"] == seed:
                    a["seed"] = "start"
            if n["op"] == "to_device":
                n["attrs"]["device"] = n["attrs"]["device"].split(":")[0]
        text = json.dumps(d, sort_keys=True, separators=(",", ":"), allow_nan=False)
        return hashlib.sha256(text.encode()).hexdigest()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Graph:
        """The loader: a Graph from to_dict()'s form, checked against the op schemas (unknown
        ops, missing or mistyped attributes, dangling ids raise ValueError / TypeError)."""
        if not isinstance(d, Mapping) or d.get("format") != FORMAT:
            raise ValueError(f"[load_graph] not a {FORMAT} document (no 'format': '{FORMAT}')")
        ver = d.get("schema_version")
        if ver != SCHEMA_VERSION:
            raise ValueError(
                f"[load_graph] schema_version {ver!r}: this blutrain.tensor reads version "
                f"{SCHEMA_VERSION} (docs/graph_format.md lists the changes)"
            )
        g = cls()
        try:
            for v in d["values"]:
                g._load_value(
                    v["id"],
                    list(v["shape"]),
                    list(v["strides"]),
                    v["offset"],
                    v["dtype"],
                    v["device"],
                    v.get("name", ""),
                    v["input"],
                    v["requires_grad"],
                    v["storage"],
                )
            for n in d["nodes"]:
                op = n["op"]
                g._load_node(
                    op,
                    _dec_attrs(op, n["attrs"]),
                    list(n["inputs"]),
                    list(n["outputs"]),
                    list(n["mutates"]),
                    dict(n.get("numerics", {})),
                )
            num, rng = d["numerics"], d["rng"]
            g._load_tables(
                list(d["inputs"]),
                list(d["outputs"]),
                [tuple(m) for m in d["mutations"]],
                [tuple(x) for x in d["grads"]],
                num["matmul_precision"],
                num["deterministic"],
                rng["seed"],
                rng["offset_begin"],
                rng["offset_end"],
            )
        except KeyError as e:
            raise ValueError(f"[load_graph] missing field {e}") from None
        return g

    @classmethod
    def from_json(cls, text: str) -> Graph:
        return cls.from_dict(json.loads(text))

    # -- running ------------------------------------------------------------------------------
    def replay(
        self,
        inputs: Sequence[Any] | Mapping[Any, Any] | None = None,
        *,
        set_grads: bool = True,
        current_rng: bool = True,
        check: bool = True,
    ) -> list[Any]:
        """Runs the program through the eager kernels and returns its outputs.

        inputs: tensors in `self.inputs` order, or a mapping from value names (or ids) to
        tensors; None: the tensors the capture read (`input_tensors`). Inputs the program
        writes (parameters, optimizer states) are written in place, as eager writes them;
        with set_grads, each leaf's .grad is set as the program leaves it. current_rng: random
        ops draw from the generator's current state and advance it (False: the recorded
        offsets). check: compare every result's shape, strides and dtype with the graph's.
        """
        if inputs is None:
            bound = list(self.input_tensors)
            if len(bound) != len(self.inputs):
                raise ValueError("[replay] a loaded graph needs its inputs")
        elif isinstance(inputs, Mapping):
            vals = self.values
            bound = []
            for vid in self.inputs:
                name = vals[vid]["name"]
                key = name if name in inputs else vid
                if key not in inputs:
                    raise ValueError(
                        f"[replay] no tensor for input %{vid}" + (f" ({name!r})" if name else "")
                    )
                bound.append(inputs[key])
        else:
            bound = list(inputs)
        outs, grads = self._replay(bound, current_rng, check)
        if set_grads:
            pos = {vid: i for i, vid in enumerate(self.inputs)}
            for (leaf, _), g in zip(self.grads, grads):
                if leaf in pos:  # a leaf made inside the program has no tensor outside it
                    bound[pos[leaf]].grad = g
        return list(outs)


def load_graph(src: str | os.PathLike | Mapping[str, Any]) -> Graph:
    """A Graph from JSON text, a path to a .json file, or to_dict()'s form."""
    if not isinstance(src, str | bytes | bytearray | os.PathLike | Mapping):
        raise TypeError(
            "[load_graph] argument 'src' must be JSON text, a path or a mapping, got "
            f"{src!r:.60} ({type(src).__name__})"
        )
    if isinstance(src, Mapping):
        return Graph.from_dict(src)
    if isinstance(src, os.PathLike) or (isinstance(src, str) and not src.lstrip().startswith("{")):
        with open(src) as f:
            return Graph.from_json(f.read())
    return Graph.from_json(src)
