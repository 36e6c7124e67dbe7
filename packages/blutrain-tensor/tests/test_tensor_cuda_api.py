"""bt.cuda's API surface: every function exists, and without a GPU (or without CUDA in the build)
each one raises a clear error, returns 0 / False, or is a no-op. Runs everywhere."""

from __future__ import annotations

import numpy as np
import pytest

import blutrain.tensor as bt

NAMES = [
    "is_available", "device_count", "synchronize", "current_stream", "set_stream", "stream",
    "Event", "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "reset_peak_memory_stats", "empty_cache", "memory_summary", "memory_stats", "manual_seed",
    "manual_seed_all", "get_device_name", "CUDAGraph", "graph", "make_graphed_step",
    "is_current_stream_capturing", "use_deterministic_algorithms",
    "are_deterministic_algorithms_enabled",
]  # fmt: skip

no_gpu = pytest.mark.skipif(bt.cuda_device_count() > 0, reason="checks the GPU-less behaviour")


def test_api_exists():
    for name in NAMES:
        assert hasattr(bt.cuda, name), name
        assert name in bt.cuda.__all__, name
    assert bt.use_deterministic_algorithms is bt.cuda.use_deterministic_algorithms
    assert bt.are_deterministic_algorithms_enabled is bt.cuda.are_deterministic_algorithms_enabled


def test_is_available_matches_device_count():
    assert bt.cuda.is_available() == (bt.cuda.device_count() > 0)
    assert bt.cuda.device_count() == (bt.cuda_device_count() if bt.cuda_built() else 0)


@no_gpu
def test_without_gpu_queries_answer_zero():
    assert bt.cuda.is_available() is False
    assert bt.cuda.device_count() == 0
    assert bt.cuda.is_current_stream_capturing() is False
    for f in (bt.cuda.memory_allocated, bt.cuda.max_memory_allocated, bt.cuda.memory_reserved,
              bt.cuda.max_memory_reserved):  # fmt: skip
        assert f() == 0
    assert bt.cuda.memory_stats() == {}
    assert "no CUDA device" in bt.cuda.memory_summary()
    bt.cuda.reset_peak_memory_stats()  # no-ops
    bt.cuda.empty_cache()


@no_gpu
@pytest.mark.parametrize(
    "call",
    [
        lambda: bt.cuda.synchronize(),
        lambda: bt.cuda.current_stream(),
        lambda: bt.cuda.set_stream(0),
        lambda: bt.cuda.get_device_name(),
        lambda: bt.cuda.Event().record(),
        lambda: bt.cuda.CUDAGraph().capture_begin(),
        lambda: bt.cuda.stream(0).__enter__(),
    ],
    ids=[
        "synchronize",
        "current_stream",
        "set_stream",
        "get_device_name",
        "Event.record",
        "CUDAGraph.capture_begin",
        "stream",
    ],  # fmt: skip
)
def test_without_gpu_device_calls_raise_clearly(call):
    with pytest.raises(
        RuntimeError, match=r"^\[cuda\.\w+(\.\w+)?\] .*(without CUDA|no CUDA device)"
    ):
        call()


@no_gpu
def test_without_gpu_graph_context_raises_and_restores_linalg():
    la = pytest.importorskip("blutrain.linalg")
    before = la.get_option("autotune")
    g = bt.cuda.CUDAGraph()
    ran = []
    with pytest.raises(RuntimeError, match="CUDAGraph.capture_begin"):
        with bt.cuda.graph(g):
            ran.append(1)
    assert ran == [] and not g.captured and g.pool() is None
    assert la.get_option("autotune") == before
    g.reset()  # harmless on an empty graph
    with pytest.raises(RuntimeError, match="nothing captured|without CUDA"):
        g.replay()


def test_event_before_record():
    e = bt.cuda.Event(enable_timing=False)
    assert "not recorded" in repr(e)
    with pytest.raises(RuntimeError, match=r"\[cuda.Event.query\] the event was never recorded"):
        e.query()
    with pytest.raises(RuntimeError, match="never recorded"):
        e.elapsed_time(bt.cuda.Event())


def test_bad_device_arguments():
    with pytest.raises(ValueError, match=r"\[cuda.synchronize\] not a CUDA device"):
        bt.cuda.synchronize("cpu")
    with pytest.raises(TypeError, match="device must be"):
        bt.cuda.synchronize(True)


def test_manual_seed_is_the_shared_generator():
    bt.cuda.manual_seed(77)
    a = bt.randn(16).numpy()
    assert bt.initial_seed() == 77
    bt.manual_seed(77)
    np.testing.assert_array_equal(a, bt.randn(16).numpy())
    bt.cuda.manual_seed_all(78)
    assert bt.initial_seed() == 78


def test_deterministic_mode_toggles_and_pins_linalg_autotune():
    la = pytest.importorskip("blutrain.linalg")
    prev = bt.are_deterministic_algorithms_enabled()
    old = la.get_option("autotune")
    try:
        la.set_option("autotune", 1)
        bt.use_deterministic_algorithms(True)
        assert bt.are_deterministic_algorithms_enabled() is True
        assert la.get_option("autotune") == 0
        bt.use_deterministic_algorithms(True)  # idempotent: still restores the user's 1 later
        bt.use_deterministic_algorithms(False)
        assert bt.are_deterministic_algorithms_enabled() is False
        assert la.get_option("autotune") == 1
    finally:
        bt.use_deterministic_algorithms(prev)
        la.set_option("autotune", old)


def test_memory_summary_is_text():
    assert isinstance(bt.cuda.memory_summary(), str)
