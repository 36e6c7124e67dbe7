"""Captured graphs on a GPU: every replay case of test_tensor_capture_replay.py on CUDA tensors,
eager against replay bit for bit (in deterministic mode: without it the bf16 attention backward
and scatter_add add with float atomics, which differ run to run); a transfer (to_device)
recorded and replayed; a graph captured on the GPU hashes as one captured on another GPU."""

from __future__ import annotations

import numpy as np
import pytest
from test_tensor_capture_replay import CASES, _bytes, run

import blutrain.tensor as bt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bt.cuda_device_count() == 0, reason="no CUDA device"),
]


@pytest.fixture
def deterministic():
    prev = bt.are_deterministic_algorithms_enabled()
    bt.use_deterministic_algorithms(True)
    yield
    bt.use_deterministic_algorithms(prev)


@pytest.mark.parametrize("name", sorted(CASES))
def test_replay_equals_eager_bitwise_on_cuda(name, deterministic):
    g = run(CASES[name], device="cuda")
    assert any(v["device"].startswith("cuda") for v in g.values)
    dets = [n["numerics"]["deterministic"] for n in g.nodes if "deterministic" in n["numerics"]]
    assert all(dets)


def test_to_device_is_recorded_and_replayed():
    a = bt.tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
    w = bt.tensor(np.ones((4, 2), np.float32), device="cuda", requires_grad=True)
    with bt.capture() as g:
        y = (a.cuda() @ w).relu()
        y.sum().backward()
        g.mark_output(y.cpu())
        g.mark_output(w.grad)
    ops = [n["op"] for n in g.nodes]
    assert ops.count("to_device") >= 2
    td = next(n for n in g.nodes if n["op"] == "to_device")
    assert td["attrs"]["device"].startswith("cuda")
    eager_y = (a.cuda() @ w).relu()
    eager_y.sum().backward()
    want = [_bytes(eager_y.cpu()), _bytes(w.grad)]
    w.grad = None
    assert [_bytes(t) for t in g.replay()] == want
    # the loaded graph runs too, and a transfer's device index does not enter the hash
    h = bt.load_graph(g.to_json())
    assert h.hash() == g.hash()
    d = g.to_dict()
    for n in d["nodes"]:
        if n["op"] == "to_device" and n["attrs"]["device"].startswith("cuda"):
            n["attrs"]["device"] = "cuda:7"  # (the transfer back to the CPU stays one)
    for v in d["values"]:
        v["device"] = v["device"].replace("cuda:0", "cuda:7")
    moved = bt.load_graph(d)
    if moved.hash() != g.hash():  # say what differs, beyond the device index
        a, b = moved.to_dict(), g.to_dict()
        diff = [
            (k, i, x, y)
            for k in ("values", "nodes")
            for i, (x, y) in enumerate(zip(a[k], b[k]))
            if {**x, "device": "", "name": ""} != {**y, "device": "", "name": ""}
        ]
        top = {k: (a[k], b[k]) for k in a if k not in ("values", "nodes") and a[k] != b[k]}
        raise AssertionError(f"hash differs: {diff[:3]} {top}")
