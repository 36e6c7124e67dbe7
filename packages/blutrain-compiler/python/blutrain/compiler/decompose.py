"""Graph rewrites before fusion: multi-tensor optimizer ops split per tensor.

`adamw_`, `grad_norm` and `scale_` each take every parameter at once (one eager launch). As one
node they would pull every parameter's update into one fused group: one enormous function (slow
to compile) that recomputes the step's scalars for every element. Split, each parameter's
update is its own kernel (or fuses with the backward op that produced its gradient), and the
scalars every update shares are computed once:

  adamw_(params, grads, m, v, [copies], [lr], [step], [scale])
    -> adamw_scalars(lr, step)                  -> 0-d float64: lr / bias1, sqrt(bias2), lr
    -> adamw_update(p, g, m, v, scalars, [scale], [copy])  per tensor, same output values
  grad_norm(g_1..g_n) -> sumsq(g_i) per tensor (eager's chunked order) -> sqrt_sum(...)
  scale_(t_1..t_n, coef) -> scale_(t_i, coef) per tensor

The values the original nodes produced keep their ids, so nothing downstream changes.
"""

from __future__ import annotations

from .graph import Graph, Node, Value

# Note [column sums in two stages]: on the GPU a fused group's reduction over leading dims (a
# norm's weight gradient: (B, T, C) -> (C,)) maps to a thread per kept element, serial over the
# rows: 512 threads for LLaMA small's (8, 512, 512) -> (512,), a few SMs busy for 2.3 ms (H100),
# 16 such groups a step. Split, the rows go to COLUMN_SPLIT_ROWS-row chunks: (R / k, k, C...)
# summed over k first (R / k times as many threads), then over the chunks. Fusion keeps both
# stages in the group. The order of additions changes (chunked, as eager's own CUDA column
# reduction): GPU targets only, where results match eager to a tolerance, not bit for bit.
COLUMN_SPLIT_ROWS = 32  # rows a thread adds in the first stage
COLUMN_SPLIT_MIN_ROWS = 2048  # fewer rows: one stage
COLUMN_SPLIT_MAX_KEPT = 1 << 16  # more kept elements than this fill the GPU already


def _column_split(n: Node, g: Graph) -> int:
    """Rows per first-stage chunk for a sum over a prefix of dims, or 0 (not split)."""
    if n.op != "sum" or len(n.inputs) != 1:
        return 0
    shape = g.values[n.inputs[0]].shape
    dims = sorted(int(d) % len(shape) for d in n.attrs.get("dims") or ()) if shape else []
    if not dims or dims != list(range(len(dims))) or len(dims) == len(shape):
        return 0
    rows = 1
    for d in dims:
        rows *= shape[d]
    kept = 1
    for d in shape[len(dims) :]:
        kept *= d
    if rows < COLUMN_SPLIT_MIN_ROWS or kept > COLUMN_SPLIT_MAX_KEPT:
        return 0
    if g.values[n.inputs[0]].dtype not in ("float32", "bfloat16", "float16"):
        return 0
    k = COLUMN_SPLIT_ROWS
    return k if rows % k == 0 else 0


def decompose(g: Graph, gpu: bool = False) -> Graph:
    nodes: list[Node] = []
    nxt = max(g.values) + 1 if g.values else 0

    def new_value(shape: tuple[int, ...], dtype: str, device: str) -> int:
        nonlocal nxt
        v = Value(nxt, shape, dtype, device)
        g.values[nxt] = v
        nxt += 1
        return v.id

    for n in g.nodes:
        dev = g.values[n.outputs[0]].device if n.outputs else "cpu"
        if n.op == "adamw_" and int(n.attrs["n"]) > 0:
            a = n.attrs
            k = int(a["n"])
            copies = bool(a.get("has_copies"))
            ins = list(n.inputs)
            j = 5 * k if copies else 4 * k
            lr = ins[j] if a.get("has_lr") else -1
            j += 1 if a.get("has_lr") else 0
            step = ins[j] if a.get("has_step") else -1
            j += 1 if a.get("has_step") else 0
            scale = ins[j] if a.get("has_scale") else -1
            sc = [new_value((), "float64", dev) for _ in range(3)]
            nodes.append(
                Node(
                    "adamw_scalars",
                    {
                        "lr": float(a.get("lr", 0.0)),
                        "step": float(a.get("step", 0)),
                        "beta1": float(a["beta1"]),
                        "beta2": float(a["beta2"]),
                    },
                    [lr, step],
                    sc,
                )
            )
            outs = list(n.outputs)
            for t in range(k):
                tin = [ins[t], ins[k + t], ins[2 * k + t], ins[3 * k + t]] + sc + [scale]
                tout = [outs[t], outs[k + t], outs[2 * k + t]]
                if copies:
                    tin.append(ins[4 * k + t])
                    tout.append(outs[3 * k + t])
                nodes.append(
                    Node(
                        "adamw_update",
                        {
                            "beta1": float(a["beta1"]),
                            "beta2": float(a["beta2"]),
                            "eps": float(a["eps"]),
                            "weight_decay": float(a["weight_decays"][t]),
                            "has_copy": copies,
                        },
                        tin,
                        tout,
                    )
                )
            continue
        if n.op == "grad_norm" and len(n.inputs) > 1:
            parts = []
            for i in n.inputs:
                p = new_value((), "float64", dev)
                nodes.append(Node("sumsq", {}, [i], [p]))
                parts.append(p)
            nodes.append(Node("sqrt_sum", {}, parts, list(n.outputs)))
            continue
        if n.op == "scale_" and len(n.inputs) > 2:
            coef = n.inputs[-1]
            for i, o in zip(n.inputs[:-1], n.outputs):
                nodes.append(Node("scale_", dict(n.attrs), [i, coef], [o]))
            continue
        k = _column_split(n, g) if gpu else 0
        if k:  # Note [column sums in two stages]
            x = g.values[n.inputs[0]]
            nd = len(n.attrs["dims"])
            rows = 1
            for d in x.shape[:nd]:
                rows *= d
            kept = tuple(x.shape[nd:])
            r = new_value((rows // k, k) + kept, x.dtype, x.device)
            nodes.append(Node("reshape", {"shape": (rows // k, k) + kept}, [x.id], [r]))
            part = new_value((rows // k,) + kept, g.values[n.outputs[0]].dtype, x.device)
            nodes.append(Node("sum", {"dims": (1,), "keepdim": False}, [r], [part]))
            out = g.values[n.outputs[0]]
            if tuple(out.shape) == kept:
                nodes.append(Node("sum", {"dims": (0,), "keepdim": False}, [part], [out.id]))
            else:  # keepdim: the reduced dims stay as 1s
                flat = new_value(kept, out.dtype, x.device)
                nodes.append(Node("sum", {"dims": (0,), "keepdim": False}, [part], [flat]))
                nodes.append(Node("reshape", {"shape": tuple(out.shape)}, [flat], [out.id]))
            continue
        nodes.append(n)
    g.nodes = nodes
    g.reindex()
    return g
