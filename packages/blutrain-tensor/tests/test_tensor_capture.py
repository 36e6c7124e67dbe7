"""Capture mode: ops record a graph (op, dtypes, shapes, attributes, inputs) instead of running."""

from __future__ import annotations

from collections import Counter

import pytest
from tensor_gpt2_block import Block

import blutrain.tensor as bt


def test_capture_records_without_running():
    x = bt.randn(4, 8)
    w = bt.randn(8, 3, requires_grad=True)
    with bt.capture() as g:
        y = (x @ w).relu().sum(1)
        g.mark_output(y)
    assert y.is_symbolic and y.shape == (4,) and y.dtype == bt.float32
    ops = [n["op"] for n in g.nodes]
    assert ops == ["matmul", "relu", "sum"]
    mm = g.nodes[0]
    vals = {v["id"]: v for v in g.values}
    assert [vals[i]["shape"] for i in mm["inputs"]] == [(4, 8), (8, 3)]
    assert vals[mm["outputs"][0]]["shape"] == (4, 3)
    assert g.nodes[2]["attrs"] == {"dims": (1,), "keepdim": False}
    assert len(g.inputs) == 2 and g.outputs == [g.nodes[2]["outputs"][0]]
    assert "matmul(%0, %1)" in str(g)
    assert not bt._C._capturing()
    # eager again afterwards
    assert not (x @ w).is_symbolic


def test_capture_inplace_is_ssa_renamed():
    a = bt.ones(3)
    with bt.capture() as g:
        b = a * 2
        b.add_(1)
        c = b * b
    ops = [n["op"] for n in g.nodes]
    assert "copy_" in ops
    copy = g.nodes[ops.index("copy_")]
    mul2 = g.nodes[-1]
    assert mul2["inputs"] == [copy["outputs"][0]] * 2
    assert c.is_symbolic


def test_capture_gpt2_block_forward_and_backward():
    bt.manual_seed(0)
    block = Block(n_embd=32, n_head=4, dropout=0.1)
    block.name_parameters()
    params = dict(block.named_parameters())
    x = bt.randn(2, 8, 32)
    with bt.capture() as g:
        y = block(x)
        loss = (y * y).mean()
        loss.backward()
        g.mark_output(loss)
    ops = Counter(n["op"] for n in g.nodes)
    # forward
    assert ops["layer_norm"] == 2 and ops["linear"] >= 4 and ops["softmax"] == 1
    assert ops["gelu_tanh"] == 1 and ops["dropout"] >= 3 and ops["matmul"] >= 2
    # backward: matmuls for the gradients, and one accumulate_grad per parameter
    acc = [n for n in g.nodes if n["op"] == "accumulate_grad"]
    vals = {v["id"]: v for v in g.values}
    assert len(acc) == len(params) == 12
    named = {vals[n["inputs"][0]]["name"]: vals[n["inputs"][1]] for n in acc}
    assert set(named) == set(params)
    for name, p in params.items():
        assert named[name]["shape"] == p.shape and named[name]["dtype"] == p.dtype
        assert p.grad is None  # nothing ran
    # attributes a compiler needs are present
    sm = next(n for n in g.nodes if n["op"] == "softmax")
    assert sm["attrs"] == {"dim": -1}
    dr = next(n for n in g.nodes if n["op"] == "dropout")
    assert set(dr["attrs"]) == {"p", "seed", "offset"}
    ln = next(n for n in g.nodes if n["op"] == "layer_norm")
    assert ln["attrs"]["eps"] == pytest.approx(1e-5)
    assert len(ln["outputs"]) == 3
    # the block's parameters and x are the graph's inputs; x needs no gradient
    names = {vals[i]["name"] for i in g.inputs}
    assert set(params) <= names
    # and the same block still runs eagerly
    block.eval()
    out = block(x)
    assert out.shape == (2, 8, 32) and not out.is_symbolic
    (out * out).mean().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in block.parameters())


def test_capture_random_and_creation_ops():
    with bt.capture() as g:
        r = bt.randn(3, 4)
        z = bt.zeros(2)
        e = bt.empty(5)
    assert r.is_symbolic and z.is_symbolic and e.is_symbolic
    kinds = [(n["op"], n["attrs"].get("kind")) for n in g.nodes]
    assert kinds[0] == ("random", "normal")
    with pytest.raises(RuntimeError, match=r"\[capture\] a capture is already active"):
        with bt.capture():
            with bt.capture():
                pass


# ---- the eager op log (bt.op_log) ---------------------------------------------------------------
def test_op_log_notes_eager_primitives_with_dtypes_not_views_nor_captures():
    """Every primitive evaluated eagerly, forward and backward, with its inputs' and outputs'
    (dtype, shape); views move no data and are left out; a capture records its own graph."""
    a = bt.ones((2, 3), requires_grad=True)
    with bt.op_log() as log:
        b = (a * 2.0).to(bt.bfloat16).reshape(3, 2)
        b.float().sum().backward()
    assert all(isinstance(e, bt.OpLogEntry) for e in log)
    ops = [e.op for e in log]
    assert "reshape" not in ops and "view" not in ops
    # in order: the forward's cast first (the backward of .float() casts to bfloat16 too)
    cast = next(e for e in log if e.op == "astype" and e.outputs[0][0] == "bfloat16")
    assert (
        ops.index("mul") < ops.index("astype")
        and cast.inputs == [("float32", (2, 3))]
        and cast.outputs == [("bfloat16", (2, 3))]
    )
    mul = log[ops.index("mul")]
    # (the number 2.0 reaches the kernel as a broadcast view of a's shape)
    assert mul == ("mul", [("float32", (2, 3))] * 2, [("float32", (2, 3))]), mul
    # the backward ran too: its casts take the gradient back to float32
    assert sum(1 for e in log if e.op == "astype") >= 3
    assert a.grad is not None
    with bt.op_log() as log2:
        with bt.capture():
            _ = bt.zeros((4,)) + 1
    assert log2 == []


def test_op_log_is_off_outside_its_block_filled_when_it_raises_and_not_nested():
    x = bt.ones((4,))
    with bt.op_log() as log:
        x + x
    assert [e.op for e in log] == ["add"]
    x * x  # off: nothing noted, in this list or the next
    assert [e.op for e in log] == ["add"] and not bt._C._op_log_on()
    with pytest.raises(ZeroDivisionError):
        with bt.op_log() as log:
            x.exp()
            raise ZeroDivisionError
    assert [e.op for e in log] == ["exp"] and not bt._C._op_log_on()
    with bt.op_log() as outer:
        x.neg()
        with pytest.raises(RuntimeError, match=r"^\[op_log\] an op log is already recording"):
            with bt.op_log():
                pass
        x.sqrt()
    assert [e.op for e in outer] == ["neg", "sqrt"]  # the refused inner log cleared nothing
    with bt.op_log() as empty:
        pass
    assert empty == []
