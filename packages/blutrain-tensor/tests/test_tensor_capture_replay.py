"""Replay of captured graphs equals eager bit for bit, op by op (docs/graph_format.md).

Each case is a function of fresh tensors that runs ops (and usually a backward) and returns the
tensors to compare. It runs three times on equal inputs: eagerly, captured, and the capture
replayed (Graph.replay, the eager primitives rebuilt from the recorded attributes); eager and
replay must agree to the bit (raw bytes: NaN payloads and signed zeros included), and so must
every input the case writes in place. A coverage test requires every op of the schema to occur
in some case's graph, so a new primitive needs a case here.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pytest

import blutrain.tensor as bt
import blutrain.tensor.optim as bto

# ops a CPU capture cannot record: capture casts plainly (no cast cache), and transfers need a
# GPU (test_tensor_cuda_capture.py)
# (gelu_tanh_backward: gelu_tanh_grad composes the ops for symbolic tensors, so a captured graph
# replays on CUDA too, which has no fused kernel; test_tensor_nn_fused.py checks the primitive)
NOT_ON_CPU = {
    "cached_astype": "capture records astype",
    "to_device": "needs a CUDA device",
    "gelu_tanh_backward": "capture records the composed ops",
}

CASES: dict[str, Callable] = {}


def case(fn):
    """Registers a case (a function of Inputs returning the tensors to compare)."""
    CASES[fn.__name__] = fn
    return fn


class Inputs:
    """Fresh tensors from one numpy seed: the same values every time a case asks.

    The eager pass logs what was asked; the capture pass is served tensors made beforehand
    (outside the capture), so they are the graph's inputs, as parameters and batches are."""

    def __init__(self, seed: int, made: list[bt.Tensor] | None = None, device: str = "cpu") -> None:
        self.rng = np.random.default_rng(seed)
        self.log: list[tuple[np.ndarray, bool]] = []
        self.made = made
        self.device = device

    def _make(self, a: np.ndarray, grad: bool) -> bt.Tensor:
        if self.made is not None:
            return self.made.pop(0)
        self.log.append((a, grad))
        return bt.tensor(a, requires_grad=grad, device=self.device)

    def f(self, *shape: int, grad: bool = False, dtype=np.float32, lo=-2.0, hi=2.0) -> bt.Tensor:
        return self._make(self.rng.uniform(lo, hi, shape).astype(dtype), grad)

    def i(self, high: int, *shape: int) -> bt.Tensor:
        return self._make(self.rng.integers(0, high, shape).astype(np.int64), False)

    def again(self) -> Inputs:
        """An Inputs serving fresh copies of everything this one made, made now."""
        made = [bt.tensor(a, requires_grad=g, device=self.device) for a, g in self.log]
        return Inputs(0, made, self.device)


Case = Callable[[Inputs], list[bt.Tensor]]


def _bytes(t: bt.Tensor) -> tuple:
    a = t.detach().contiguous().cpu().numpy()
    return (a.dtype.str, a.shape, a.tobytes())


def run(case: Case, seed: int = 0, device: str = "cpu") -> bt.Graph:
    """Eager vs replay of `case` on `device`; returns the graph."""
    bt.manual_seed(1234)
    first = Inputs(seed, device=device)
    eager = [_bytes(t) for t in case(first)]
    served = first.again()
    bt.manual_seed(1234)
    with bt.capture() as g:
        outs = case(served)
        for t in outs:
            g.mark_output(t)
    # replay on the tensors the capture read (their data is untouched by the capture)
    bt.manual_seed(1234)
    replayed = [_bytes(t) for t in g.replay()]
    assert len(eager) == len(replayed)
    for k, (e, r) in enumerate(zip(eager, replayed)):
        assert e[:2] == r[:2], f"output {k}: {e[:2]} vs {r[:2]}"
        assert e[2] == r[2], f"output {k} differs between eager and replay"
    return g


def _loss(*ts: bt.Tensor) -> bt.Tensor:
    """A scalar that sends a different gradient to every element (not a plain sum)."""
    total = None
    for k, t in enumerate(ts):
        w = bt.arange(t.numel(), dtype=t.dtype, device=str(t.device)).reshape(tuple(t.shape))
        w = w * (0.01 * (k + 1)) + 0.5
        s = (t * w).sum()
        total = s if total is None else total + s
    return total


# ---- the cases ------------------------------------------------------------------------------


@case
def creation(x: Inputs):
    return [
        bt.full((2, 3), 0.1, device=x.device),
        bt.arange(5, device=x.device),
        bt.arange(0.5, 3.0, 0.25, dtype=bt.float64, device=x.device),
        bt.rand(3, 4, device=x.device),
        bt.randn(5, dtype=bt.float64, device=x.device),
        bt.randint(0, 7, (4,), device=x.device),
        bt.zeros(3, device=x.device) + bt.ones(3, device=x.device),
    ]


UNARY = [
    ("neg", lambda t: -t),
    ("exp", bt.exp),
    ("log", bt.log),
    ("sqrt", bt.sqrt),
    ("rsqrt", bt.rsqrt),
    ("tanh", bt.tanh),
    ("abs", bt.abs),
    ("sigmoid", bt.sigmoid),
    ("relu", bt.relu),
    ("sin", bt.sin),
    ("cos", bt.cos),
    ("erf", bt.erf),
    ("gelu", bt.gelu),
    ("gelu_tanh", lambda t: bt.gelu(t, approximate="tanh")),
]


def _unary(x: Inputs, dtype):
    a = x.f(3, 5, grad=True, dtype=dtype, lo=0.2, hi=2.0)
    b = x.f(4, 6, dtype=dtype).transpose(0, 1)  # strided: results keep its layout
    outs = [fn(a) for _, fn in UNARY]
    outs += [fn(b) for name, fn in UNARY if name not in ("log", "sqrt", "rsqrt")]
    _loss(*outs[: len(UNARY)]).backward()
    return outs + [a.grad, bt.sign(b), bt.logical_not(b > 0)]


@case
def unary_f32(x: Inputs):
    return _unary(x, np.float32)


@case
def unary_f64(x: Inputs):
    return _unary(x, np.float64)


@case
def binary(x: Inputs):
    a = x.f(3, 4, grad=True, lo=0.5, hi=2.0)
    b = x.f(4, grad=True, lo=0.5, hi=2.0)
    ys = [a + b, a - b, a * b, a / b, a**b, bt.maximum(a, b), bt.minimum(a, b), a * 2.5, 1 - a]
    _loss(*ys).backward()
    ai, bi = x.i(9, 3, 4) - 4, x.i(5, 4) + 1
    cmp = [a == b, a != b, a < b, a <= b, a > b, a >= b]
    logic = [bt.logical_not(cmp[2]), (a < b) & (a > 1.0), (a < b) | (a > 1.0)]
    return ys + [a.grad, b.grad, ai // bi, ai % bi, a // b, a % b] + cmp + logic


@case
def where_masked_fill(x: Inputs):
    a = x.f(4, 5, grad=True)
    b = x.f(4, 5, grad=True)
    m = a > b
    ys = [bt.where(m, a, b), a.masked_fill(m, float("-inf")), bt.masked_fill(b, m, 0.3)]
    _loss(ys[0], ys[2]).backward()
    return ys + [a.grad, b.grad, a.clamp(-0.5, 0.5)]


@case
def reductions(x: Inputs):
    a = x.f(3, 4, 5, grad=True)
    ys = [
        a.sum(),
        a.sum(1, keepdim=True),
        a.mean((0, 2)),
        a.amax(-1),
        a.amin(0, keepdim=True),
        a.var(1),
        bt.var(a, (0, 2), correction=0),
    ]
    _loss(*ys).backward()
    mx = a.max(1)
    return ys + [a.grad, a.argmax(2), a.argmin(0, keepdim=True), mx.values, mx.indices]


@case
def views_and_joins(x: Inputs):
    a = x.f(4, 6, grad=True)
    b = x.f(2, 6, grad=True)
    ys = [
        a.reshape(3, 8),
        a.permute(1, 0),
        a[:, None].expand(4, 3, 6),
        a[1:3, ::2],
        a[2],
        a.T.contiguous(),
        bt.cat([a, b], 0),
        bt.stack([a[:2], b], 1),
    ]
    _loss(*ys).backward()
    c = x.f(4, 6)
    c[1:3] = x.f(2, 6)  # slice_scatter, renaming c
    return ys + [a.grad, b.grad, c]


@case
def indexing(x: Inputs):
    w = x.f(10, 4, grad=True)
    idx = x.i(10, 7)
    src = x.f(7, 4, grad=True)
    base = x.f(10, 4, grad=True)
    g_idx = x.i(4, 10, 4)
    ys = [
        bt.index_select(w, 0, idx),
        bt.embedding(idx.reshape(1, 7), w),
        bt.index_add(base, 0, idx, src),
        bt.gather(w, 1, g_idx),
        bt.scatter_add(base, 1, g_idx, w),
        w[idx],
    ]
    _loss(*ys).backward()
    return ys + [w.grad, src.grad, base.grad]


@case
def softmax_layer_norm_dropout(x: Inputs):
    a = x.f(3, 8, grad=True)
    w = x.f(8, grad=True)
    b = x.f(8, grad=True)
    ys = [
        bt.softmax(a, -1),
        bt.log_softmax(a, 0),
        bt.layer_norm(a, (8,), w, b, 1e-5),
        bt.layer_norm(a, (8,), None, None, 0.1),
        bt.dropout(a, 0.3, True),
    ]
    _loss(*ys).backward()
    return ys + [a.grad, w.grad, b.grad]


def _cross_entropy(x: Inputs, reduction: str):
    logits = x.f(6, 9, grad=True)
    t = x.i(9, 6)
    t[1] = -100  # an ignored row
    loss = bt.cross_entropy(logits, t, reduction=reduction, label_smoothing=0.1)
    _loss(loss).backward()
    return [loss, logits.grad]


@case
def cross_entropy_mean(x: Inputs):
    return _cross_entropy(x, "mean")


@case
def cross_entropy_sum(x: Inputs):
    return _cross_entropy(x, "sum")


@case
def cross_entropy_none(x: Inputs):
    return _cross_entropy(x, "none")


@case
def matmul_linear(x: Inputs):
    a = x.f(2, 3, 5, grad=True)
    b = x.f(5, 4, grad=True)
    w = x.f(6, 5, grad=True)
    bias = x.f(6, grad=True)
    ys = [a @ b, bt.matmul(a[0], b), bt.linear(a, w, bias), bt.linear(a, w), bt.bmm(a, a.mT)]
    _loss(*ys).backward()
    return ys + [a.grad, b.grad, w.grad, bias.grad]


@case
def fused_layers(x: Inputs):
    h = x.f(6, 8, grad=True)
    r = x.f(6, 8, grad=True)
    w1, b1 = x.f(12, 8, grad=True), x.f(12, grad=True)
    w2, b2 = x.f(8, 12, grad=True), x.f(8, grad=True)
    lw, lb, rb = x.f(8, grad=True), x.f(8, grad=True), x.f(8, grad=True)
    s, y = bt.add_layer_norm(h, r, lw, lb, 1e-5, residual_bias=rb)
    g1 = bt.linear_gelu(h, w1, b1)
    mlp = bt.linear_gelu_linear(h, w1, b1, w2, b2)
    head = x.f(11, 8, grad=True)
    ce = bt.linear_cross_entropy(y, head, x.i(9, 6), num_classes=9)
    _loss(s, y, g1, mlp, ce).backward()
    grads = [t.grad for t in (h, r, w1, b1, w2, b2, lw, lb, rb, head)]
    return [s, y, g1, mlp, ce] + grads


@case
def attention(x: Inputs):
    q = x.f(2, 3, 5, 4, grad=True)
    k = x.f(2, 3, 5, 4, grad=True)
    v = x.f(2, 3, 5, 4, grad=True)
    o, lse = bt._tensor.flash_attention(q, k, v, True)
    p = x.f(2, 5, 24, grad=True)
    po, plse = bt._tensor.flash_attention_packed(p, 2, True)
    xa = x.f(2, 5, 8, grad=True)
    wa, ba = x.f(24, 8, grad=True), x.f(24, grad=True)
    with bt.backends.use_flash_attention_cpu(True):  # qkv_attention's fused node on the CPU
        qa = bt.qkv_attention(xa, wa, ba, 2, is_causal=True)
    _loss(o, lse, po, qa).backward()
    return [o, lse, po, plse, qa] + [t.grad for t in (q, k, v, p, xa, wa, ba)]


@case
def optimizer(x: Inputs):
    ps = [x.f(3, 4), x.f(5)]
    gs = [x.f(3, 4), x.f(5)]
    ms = [x.f(3, 4), x.f(5)]
    vs = [x.f(3, 4, lo=0.0, hi=1.0), x.f(5, lo=0.0, hi=1.0)]
    norm = bto.grad_norm(gs)
    coef = bto.clip_coef(norm, 0.5)
    lr, step = bt.tensor(1e-3, device=x.device), bt.tensor(3.0, device=x.device)
    bto.adamw_(ps, gs, ms, vs, lr=lr, step=step, betas=(0.9, 0.95), eps=1e-8,
               weight_decay=[0.1, 0.0], grad_scale=coef)  # fmt: skip
    bto.adamw_(ps, gs, ms, vs, lr=2e-3, step=4.0, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01)
    bto.scale_(gs, coef)
    return [norm, coef] + ps + ms + vs + gs


@case
def inplace_and_accumulation(x: Inputs):
    a = x.f(3, 4)
    w = x.f(4, 2, grad=True)
    a.add_(1.5)
    a.mul_(a)
    (a @ w).sum().backward()  # w.grad: fresh
    ((a @ w) ** 2).sum().backward()  # w.grad: accumulated in place
    return [a, w.grad]


# ---- the tests ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_replay_equals_eager_bitwise(name):
    run(CASES[name])


def test_cross_entropy_records_every_attribute():
    g = run(CASES["cross_entropy_sum"])
    (ce,) = [n for n in g.nodes if n["op"] == "cross_entropy"]
    assert ce["attrs"] == {
        "ignore_index": -100,
        "label_smoothing": 0.1,
        "num_classes": -1,
        "reduction": "sum",
    }
    (bw,) = [n for n in g.nodes if n["op"] == "cross_entropy_backward"]
    assert bw["attrs"]["label_smoothing"] == 0.1 and bw["attrs"]["in_place"] is False


def test_matmul_precision_is_recorded_and_replayed():
    bt.set_float32_matmul_precision("high")
    try:
        g = run(CASES["matmul_linear"])
    finally:
        bt.set_float32_matmul_precision("highest")
    mm = [n for n in g.nodes if n["op"] in ("matmul", "linear", "linear_weight_grad")]
    assert mm and all(n["numerics"]["matmul_precision"] == "high" for n in mm)
    assert g.numerics["matmul_precision"] == "high"
    # replay sets each node's precision itself (and puts the global setting back): the same
    # bits as the eager run under "high" (run() compared them), now under "highest"
    bt.manual_seed(1234)
    want = [_bytes(t) for t in g.replay()]
    assert bt.get_float32_matmul_precision() == "highest"
    # and the setting matters here: "highest" (captured now) gives other bits than "high"
    g2 = run(CASES["matmul_linear"])
    bt.manual_seed(1234)
    assert [_bytes(t) for t in g2.replay()][0] != want[0]


@pytest.mark.parametrize("prec", ["highest", "scores"])
def test_attention_precision_is_recorded_and_replayed(prec):
    """The attention ops record the float32 attention precision (the CPU's attention is float32
    either way: the bits are checked on CUDA); replay sets each node's and puts the global back."""
    bt.set_float32_attention_precision(prec)
    try:
        g = run(CASES["attention"])
    finally:
        bt.set_float32_attention_precision("matmul")
    att = [n for n in g.nodes if "attention" in n["op"]]
    assert {n["op"] for n in att} >= {"flash_attention", "flash_attention_backward"}
    assert all(n["numerics"]["attention_precision"] == prec for n in att)
    mm = [n for n in g.nodes if n["op"] == "matmul"]
    assert all("attention_precision" not in n["numerics"] for n in mm)
    g.replay()
    assert bt.get_float32_attention_precision() == "matmul"
    # a saved graph keeps it
    h = bt.load_graph(g.to_json())
    assert [n["numerics"] for n in h.nodes] == [n["numerics"] for n in g.nodes]
    d = json.loads(g.to_json())
    next(n for n in d["nodes"] if "attention_precision" in n["numerics"])["numerics"][
        "attention_precision"
    ] = "fast"
    with pytest.raises(ValueError, match="load_graph.*'matmul'.*'highest'.*got 'fast'"):
        bt.load_graph(json.dumps(d))


def test_random_ops_replay_at_the_generators_position():
    g = run(CASES["softmax_layer_norm_dropout"])
    dr, dr_back = [n for n in g.nodes if n["op"] == "dropout"]
    assert dr_back["attrs"] == dr["attrs"]  # the backward replays the mask
    assert dr["attrs"]["seed"] == 1234 and dr["attrs"]["offset"] == g.rng["offset_begin"]
    assert g.rng["offset_end"] > g.rng["offset_begin"]
    bt.manual_seed(1234)
    first = [_bytes(t) for t in g.replay()]
    second = [_bytes(t) for t in g.replay()]  # the generator moved on: a fresh mask
    assert first[4] != second[4]
    bt.manual_seed(1234)
    bt.rand(100)  # elsewhere in the stream; recorded offsets still give the captured mask
    assert [_bytes(t) for t in g.replay(current_rng=False)] == first


def test_optimizer_ops_write_their_inputs_ssa():
    g = run(CASES["optimizer"])
    ad = [n for n in g.nodes if n["op"] == "adamw_"]
    a0 = ad[0]["attrs"]
    assert a0["has_lr"] and a0["has_step"] and a0["has_scale"] and not a0["has_copies"]
    assert a0["weight_decays"] == (0.1, 0.0) and a0["n"] == 2
    assert ad[0]["mutates"] == [0, 1, 4, 5, 6, 7] and len(ad[0]["outputs"]) == 6
    assert ad[1]["attrs"]["lr"] == 2e-3 and not ad[1]["attrs"]["has_lr"]
    # the second step reads the first one's results (SSA), not the inputs
    assert ad[1]["inputs"][0] == ad[0]["outputs"][0]
    assert len(g.mutations) == 8  # 2 params, 2 + 2 moments, 2 grads (scale_)


def test_gradient_accumulation_is_recorded():
    g = run(CASES["inplace_and_accumulation"])
    acc = [n for n in g.nodes if n["op"] == "accumulate_grad"]
    assert [len(n["inputs"]) for n in acc] == [2, 3] and acc[1]["mutates"] == [2]
    assert acc[1]["inputs"][2] == acc[0]["outputs"][0]
    assert any(n["op"] == "copy_" for n in g.nodes)


def test_an_existing_grad_is_accumulated_and_put_back():
    w = bt.tensor(np.ones((2, 2), np.float32), requires_grad=True)
    (w * 3).sum().backward()
    before = w.grad.numpy().copy()
    with bt.capture() as g:
        (w * w).sum().backward()
        g.mark_output(w.grad)  # the same tensor, renamed in the graph (written in place)
    np.testing.assert_array_equal(w.grad.numpy(), before)  # nothing ran
    w_id, old_grad_id = g.inputs
    ((leaf, gid),) = g.grads
    assert leaf == w_id and g.mutations == [(old_grad_id, gid)]
    (out,) = g.replay([w, w.grad], set_grads=True)
    np.testing.assert_array_equal(out.numpy(), before + 2.0)
    np.testing.assert_array_equal(w.grad.numpy(), before + 2.0)


def test_grads_set_to_none_inside_a_capture_come_back():
    w = bt.tensor(np.ones(3, np.float32), requires_grad=True)
    w.sum().backward()
    with bt.capture() as g:
        w.grad = None
    assert w.grad is not None and g.grads == [(g.inputs[0], -1)]


def test_replay_checks_its_inputs():
    a = bt.ones(2, 3)
    with bt.capture() as g:
        g.mark_output(a * 2)
    with pytest.raises(RuntimeError, match=r"\[replay\] input 0.* has shape \(3, 2\)"):
        g.replay([bt.ones(3, 2)])
    with pytest.raises(ValueError, match=r"\[replay\] the graph has 1 inputs, got 2"):
        g.replay([a, a])
    with pytest.raises(RuntimeError, match=r"\[replay\] input 0.* strides"):
        g.replay([bt.ones(3, 2).T])


def test_stale_view_after_an_inplace_write_raises():
    with pytest.raises(RuntimeError, match=r"\[mul\] .*written in place after it was made"):
        with bt.capture():
            a = bt.ones(4) * 2
            v = a[1:3]
            a.add_(1)
            v * 2  # eager reads the new data; the graph could not say so


def test_symbolic_tensor_of_an_ended_capture_raises():
    with bt.capture():
        s = bt.ones(2) * 2
    with pytest.raises(RuntimeError, match=r"\[add\] a symbolic tensor"):
        with bt.capture():
            s + 1


def test_captured_values_carry_eagers_strides():
    a = bt.tensor(np.ones((4, 6), np.float32)).T  # (6, 4), strides (1, 6)
    with bt.capture() as g:
        y = a.exp()  # elementwise on a dense transposed input: eager keeps the layout
        z = y.reshape(24)  # not viewable: eager copies first
        g.mark_output(z)
    vals = g.values
    assert vals[g.inputs[0]]["strides"] == (1, 6)
    exp = next(n for n in g.nodes if n["op"] == "exp")
    assert vals[exp["outputs"][0]]["strides"] == tuple(a.exp().stride())
    assert "astype" in [n["op"] for n in g.nodes]  # the copy before the reshape


def test_every_schema_op_is_recorded_by_some_case():
    """A primitive without a case here fails: add one (the CPU ops) or list it in NOT_ON_CPU."""
    seen: set[str] = set()
    for fn in CASES.values():
        bt.manual_seed(0)
        x = Inputs(0)
        fn(x)
        x = x.again()
        with bt.capture() as g:
            fn(x)
        seen.update(n["op"] for n in g.nodes)
    missing = sorted(set(bt.op_schemas()) - seen - set(NOT_ON_CPU))
    assert not missing, f"ops that no replay case records: {missing}"
