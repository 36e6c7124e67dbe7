"""bt.cuda on a GPU: events, memory statistics, CUDA graph capture/replay of a training step,
the host-sync guard during capture, and determinism mode."""

from __future__ import annotations

import math

import numpy as np
import pytest

import blutrain.tensor as bt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bt.cuda_device_count() == 0, reason="no CUDA device"),
]

SYNC_MSG = "cannot copy to the host while a CUDA graph is being captured"


@pytest.fixture
def deterministic():
    """Turns determinism mode on for one test and restores the previous state."""
    prev = bt.are_deterministic_algorithms_enabled()
    bt.use_deterministic_algorithms(True)
    yield
    bt.use_deterministic_algorithms(prev)


def cuda(a: np.ndarray, requires_grad: bool = False) -> bt.Tensor:
    return bt.tensor(a, device="cuda", requires_grad=requires_grad)


def host(t: bt.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


# ---- devices, streams, events ------------------------------------------------------------------
def test_device_basics():
    assert bt.cuda.is_available()
    assert bt.cuda.device_count() == bt.cuda_device_count() >= 1
    assert isinstance(bt.cuda.get_device_name(), str) and bt.cuda.get_device_name()
    s = bt.cuda.current_stream()
    assert isinstance(s, int) and s != 0
    assert not bt.cuda.is_current_stream_capturing()
    bt.cuda.synchronize()
    with bt.cuda.stream(s):  # same stream: a no-op swap that must restore it
        assert bt.cuda.current_stream() == s
    assert bt.cuda.current_stream() == s


def test_stream_context_switches_and_restores():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    own = bt.cuda.current_stream()
    ts = torch.cuda.Stream()
    with bt.cuda.stream(ts.cuda_stream):
        assert bt.cuda.current_stream() == ts.cuda_stream
        y = cuda(np.arange(5, dtype=np.float32)) * 2
        np.testing.assert_array_equal(y.cpu().numpy(), np.arange(5) * 2)
    assert bt.cuda.current_stream() == own
    with bt.cuda.stream(ts):  # an object with .cuda_stream works too
        assert bt.cuda.current_stream() == ts.cuda_stream
    assert bt.cuda.current_stream() == own
    ts.synchronize()


def test_event_timing(rng):
    a = cuda(rng.standard_normal((512, 512)).astype(np.float32))
    a @ a  # warm-up: GEMM selection outside the timed region
    start, end = bt.cuda.Event(), bt.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b = a @ a
    end.record()
    end.synchronize()
    assert end.query() and start.query()
    ms = start.elapsed_time(end)
    assert math.isfinite(ms) and ms > 0.0, ms
    assert np.isfinite(b.cpu().numpy()).all()


def test_event_errors():
    e = bt.cuda.Event()
    with pytest.raises(RuntimeError, match=r"\[cuda.Event.synchronize\] the event was never"):
        e.synchronize()
    n1, n2 = bt.cuda.Event(enable_timing=False), bt.cuda.Event(enable_timing=False)
    n1.record()
    n2.record()
    n2.synchronize()
    with pytest.raises(ValueError, match="enable_timing"):
        n1.elapsed_time(n2)


# ---- memory statistics -------------------------------------------------------------------------
def test_memory_stats_move_with_allocations():
    bt.cuda.synchronize()
    bt.cuda.reset_peak_memory_stats()
    before = bt.cuda.memory_allocated()
    assert bt.cuda.max_memory_allocated() == before
    n = 1 << 20  # 4 MiB of float32
    x = bt.zeros(n, device="cuda")
    after = bt.cuda.memory_allocated()
    assert after >= before + 4 * n
    assert bt.cuda.max_memory_allocated() >= after
    assert bt.cuda.memory_reserved() >= after
    assert bt.cuda.max_memory_reserved() >= bt.cuda.memory_reserved()
    assert bt.cuda.memory_stats()["allocated_bytes"] == after
    assert isinstance(bt.cuda.memory_summary(), str)
    del x
    assert bt.cuda.memory_allocated() == before
    assert bt.cuda.max_memory_allocated() >= after  # the peak stays
    bt.cuda.reset_peak_memory_stats()
    assert bt.cuda.max_memory_allocated() == before
    bt.cuda.empty_cache()
    assert bt.cuda.memory_reserved() >= bt.cuda.memory_allocated()


# ---- a small MLP training step -----------------------------------------------------------------
IN, HID, OUT, BATCH, LR = 24, 40, 6, 33, 0.05


def init_params(rng) -> list[np.ndarray]:
    return [
        (rng.standard_normal((IN, HID)) / math.sqrt(IN)).astype(np.float32),
        (0.1 * rng.standard_normal(HID)).astype(np.float32),
        (rng.standard_normal((HID, OUT)) / math.sqrt(HID)).astype(np.float32),
        (0.1 * rng.standard_normal(OUT)).astype(np.float32),
    ]


def train_step(params: list[bt.Tensor], x: bt.Tensor, y: bt.Tensor) -> bt.Tensor:
    """Forward, backward and an in-place SGD update (grads re-created each step)."""
    w1, b1, w2, b2 = params
    for p in params:
        p.grad = None
    h = bt.gelu(x @ w1 + b1)
    out = h @ w2 + b2
    loss = ((out - y) * (out - y)).mean()
    loss.backward()
    with bt.no_grad():
        for p in params:
            p.sub_(p.grad * LR)
    return loss


def batches(rng, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [
        (
            rng.standard_normal((BATCH, IN)).astype(np.float32),
            rng.standard_normal((BATCH, OUT)).astype(np.float32),
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize("det", [True, False], ids=["deterministic", "default"])
def test_graph_replay_matches_eager_training(rng, det):
    prev = bt.are_deterministic_algorithms_enabled()
    bt.use_deterministic_algorithms(det)
    try:
        init = init_params(rng)
        warm, data = batches(rng, 3), batches(rng, 5)

        # Eager reference: 3 warm-up steps, then 5 steps.
        ref = [cuda(p, requires_grad=True) for p in init]
        ref_losses = []
        for x, y in warm + data:
            ref_losses.append(host(train_step(ref, cuda(x), cuda(y))))

        # Graphed: the same 3 warm-up steps eagerly on the static tensors, capture, 5 replays.
        params = [cuda(p, requires_grad=True) for p in init]
        static_x, static_y = cuda(warm[0][0]), cuda(warm[0][1])
        for x, y in warm:
            static_x.copy_(cuda(x))
            static_y.copy_(cuda(y))
            train_step(params, static_x, static_y)
        before = [host(p).copy() for p in params]
        g = bt.cuda.CUDAGraph()
        with bt.cuda.graph(g):
            static_loss = train_step(params, static_x, static_y)
        assert g.captured and g.num_nodes() > 0 and g.pool() is not None
        bt.cuda.synchronize()
        for p, b in zip(params, before):  # capture records work, it does not run it
            np.testing.assert_array_equal(host(p), b)
        for i, (x, y) in enumerate(data):
            static_x.copy_(bt.tensor(x))  # host -> device refresh, outside the capture
            static_y.copy_(cuda(y))
            g.replay()
            got = host(static_loss)
            want = ref_losses[3 + i]
            if det:
                np.testing.assert_array_equal(got, want, err_msg=f"loss of replay {i}")
            else:
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        for k, (p, r) in enumerate(zip(params, ref)):
            if det:
                np.testing.assert_array_equal(host(p), host(r), err_msg=f"param {k}")
            else:
                np.testing.assert_allclose(host(p), host(r), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(
                p.grad.cpu().numpy(), r.grad.cpu().numpy(), rtol=1e-5, atol=1e-6
            )
        g.reset()
        assert not g.captured and g.pool() is None
        with pytest.raises(RuntimeError, match="nothing captured"):
            g.replay()
    finally:
        bt.use_deterministic_algorithms(prev)


def _driver():
    """libcuda through ctypes: its memsets are what libraries (cuBLASLt) issue under capture."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        pytest.skip("no libcuda.so.1")
    u64, u32, u16, u8, sz = (
        ctypes.c_uint64,
        ctypes.c_uint32,
        ctypes.c_uint16,
        ctypes.c_uint8,
        ctypes.c_size_t,
    )
    lib.cuMemsetD8Async.argtypes = [u64, u8, sz, ctypes.c_void_p]
    lib.cuMemsetD16Async.argtypes = [u64, u16, sz, ctypes.c_void_p]
    lib.cuMemsetD32Async.argtypes = [u64, u32, sz, ctypes.c_void_p]
    lib.cuMemsetD2D16Async.argtypes = [u64, sz, u16, sz, sz, ctypes.c_void_p]
    return lib


@pytest.mark.parametrize("as_kernels", [True, False])
def test_graph_memset_nodes_run_as_fill_kernels(rng, as_kernels):
    """Note [memset nodes]: 1-, 2- and 4-byte and pitched (2-D) memsets captured from the driver
    API run as fill kernels in replays, write exactly their bytes, and stay ordered before the
    work after them; memsets_as_kernels=False keeps them as memset nodes."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    lib = _driver()
    n = int(rng.integers(3000, 6000))
    buf = torch.zeros(16 * n, dtype=torch.uint8, device="cuda")
    base, view = buf.data_ptr(), bt.from_dlpack(buf)
    o8, l8 = int(rng.integers(0, 64)), int(rng.integers(1, n))
    o16, l16 = 2 * n + 2 * int(rng.integers(0, 64)), int(rng.integers(1, n // 2))
    o32, l32 = 4 * n + 4 * int(rng.integers(0, 64)), int(rng.integers(1, n // 4))
    o2d, pitch, w, h = 8 * n, 2 * int(rng.integers(40, 64)), int(rng.integers(1, 40)), 7
    v8, v16, v32, v2d = (int(rng.integers(1, 2**b)) for b in (8, 16, 32, 16))
    poison = int(rng.integers(1, 256))

    want = np.full(16 * n, poison, dtype=np.uint8)
    want[o8 : o8 + l8] = v8
    want[o16 : o16 + 2 * l16].view(np.uint16)[:] = v16
    want[o32 : o32 + 4 * l32].view(np.uint32)[:] = v32
    for r in range(h):
        want[o2d + r * pitch : o2d + r * pitch + 2 * w].view(np.uint16)[:] = v2d

    s = bt.cuda.current_stream()
    g = bt.cuda.CUDAGraph(memsets_as_kernels=as_kernels)
    torch.cuda.synchronize()
    with bt.cuda.graph(g):
        assert lib.cuMemsetD8Async(base + o8, v8, l8, s) == 0
        assert lib.cuMemsetD16Async(base + o16, v16, l16, s) == 0
        assert lib.cuMemsetD32Async(base + o32, v32, l32, s) == 0
        assert lib.cuMemsetD2D16Async(base + o2d, pitch, v2d, w, h, s) == 0
        after = view.to(bt.int32) + 1  # reads the buffer after the memsets, in stream order
    assert g.memsets_replaced == (4 if as_kernels else 0)
    for _ in range(2):  # each replay rewrites the bytes
        buf.fill_(poison)
        torch.cuda.synchronize()
        g.replay()
        bt.cuda.synchronize()
        np.testing.assert_array_equal(buf.cpu().numpy(), want)
        np.testing.assert_array_equal(host(after), want.astype(np.int32) + 1)
    g.reset()


def test_make_graphed_step(rng):
    init = init_params(rng)
    ((x, y),) = batches(rng, 1)
    params = [cuda(p, requires_grad=True) for p in init]
    sx, sy = cuda(x), cuda(y)
    g, loss = bt.cuda.make_graphed_step(lambda a, b: train_step(params, a, b), sx, sy, warmup=2)
    before = host(params[0]).copy()
    g.replay()  # the capture itself ran nothing: `loss` is written by the first replay
    first = float(host(loss))
    for _ in range(3):
        g.replay()
    assert not np.array_equal(host(params[0]), before)
    assert float(host(loss)) < first  # the same batch: SGD lowers its loss
    g.reset()


def test_graph_memory_comes_from_private_pool():
    import blutrain.alloc as alloc

    x = bt.ones(1000, device="cuda")
    (x * 2).cpu().numpy()  # warm-up
    g = bt.cuda.CUDAGraph()
    with bt.cuda.graph(g):
        y = x * 2 + 1
    pools = {b["pool"] for b in alloc.snapshot(0) if b["allocated"]}
    assert f"graph:{g.pool()}" in pools, pools
    g.replay()
    np.testing.assert_array_equal(y.cpu().numpy(), np.full(1000, 3, np.float32))
    x.copy_(bt.ones(1000, device="cuda") * 5)
    g.replay()
    np.testing.assert_array_equal(y.cpu().numpy(), np.full(1000, 11, np.float32))
    pool = f"graph:{g.pool()}"
    g.reset()
    assert any(b["pool"] == pool and b["allocated"] for b in alloc.snapshot(0))  # y still lives
    del y
    assert not any(b["pool"] == pool and b["allocated"] for b in alloc.snapshot(0))


def test_graph_reuse_needs_reset():
    x = bt.ones(8, device="cuda")
    g = bt.cuda.CUDAGraph()
    with bt.cuda.graph(g):
        x * 2
    with pytest.raises(RuntimeError, match="already holds a capture"):
        with bt.cuda.graph(g):
            x * 3
    assert not bt.cuda.is_current_stream_capturing()
    g.reset()
    with bt.cuda.graph(g):
        y = x * 3
    g.replay()
    np.testing.assert_array_equal(y.cpu().numpy(), np.full(8, 3, np.float32))


# ---- what breaks capture raises clearly, and the stream stays usable ---------------------------
@pytest.mark.parametrize("how", ["item", "numpy", "cpu", "synchronize"])
def test_host_sync_during_capture_raises(how):
    x = bt.ones(16, device="cuda")
    (x * 2).cpu().numpy()
    g = bt.cuda.CUDAGraph()
    match = "cannot synchronize" if how == "synchronize" else SYNC_MSG
    with pytest.raises(RuntimeError, match=match):
        with bt.cuda.graph(g):
            y = (x * 2).sum()
            if how == "item":
                y.item()
            elif how == "numpy":
                y.cpu().numpy()
            elif how == "cpu":
                y.cpu()
            else:
                bt.cuda.synchronize()
    assert not g.captured and g.pool() is None
    assert not bt.cuda.is_current_stream_capturing()
    # The stream works eagerly, and the same graph object can capture afterwards.
    assert (x + 1).sum().item() == 32.0
    with bt.cuda.graph(g):
        z = x * 4
    g.replay()
    np.testing.assert_array_equal(z.cpu().numpy(), np.full(16, 4, np.float32))


def test_error_inside_capture_abandons_it():
    x = bt.ones(4, device="cuda")
    g = bt.cuda.CUDAGraph()
    with pytest.raises(KeyError):
        with bt.cuda.graph(g):
            x * 2
            raise KeyError("boom")
    assert not g.captured and not bt.cuda.is_current_stream_capturing()
    np.testing.assert_array_equal((x * 2).cpu().numpy(), np.full(4, 2, np.float32))


def test_linalg_autotune_off_during_capture_and_restored():
    la = pytest.importorskip("blutrain.linalg")
    old = la.get_option("autotune")
    la.set_option("autotune", 1)
    try:
        a = bt.ones((8, 8), device="cuda")
        (a @ a).cpu().numpy()
        g = bt.cuda.CUDAGraph()
        seen = []
        with bt.cuda.graph(g):
            seen.append(la.get_option("autotune"))
            a @ a
        assert seen == [0]
        assert la.get_option("autotune") == 1
    finally:
        la.set_option("autotune", old)


# ---- determinism ---------------------------------------------------------------------------------
def test_deterministic_mode_pins_linalg_autotune():
    la = pytest.importorskip("blutrain.linalg")
    prev = bt.are_deterministic_algorithms_enabled()
    old = la.get_option("autotune")
    la.set_option("autotune", 1)
    try:
        bt.use_deterministic_algorithms(True)
        assert bt.are_deterministic_algorithms_enabled()
        assert la.get_option("autotune") == 0
        bt.use_deterministic_algorithms(False)
        assert la.get_option("autotune") == 1
    finally:
        bt.use_deterministic_algorithms(prev)
        la.set_option("autotune", old)


def test_deterministic_training_is_bitwise_reproducible(rng, deterministic):
    init = init_params(rng)
    data = batches(rng, 3)

    def run() -> list[np.ndarray]:
        params = [cuda(p, requires_grad=True) for p in init]
        for x, y in data:
            train_step(params, cuda(x), cuda(y))
        return [host(p) for p in params] + [p.grad.cpu().numpy() for p in params]

    first, second = run(), run()
    for k, (a, b) in enumerate(zip(first, second)):
        np.testing.assert_array_equal(a, b, err_msg=f"tensor {k}")


def test_manual_seed_shared_with_gpu():
    bt.cuda.manual_seed(1234)
    a = bt.randn(64, device="cuda").cpu().numpy()
    bt.manual_seed(1234)
    b = bt.randn(64, device="cuda").cpu().numpy()
    np.testing.assert_array_equal(a, b)


def test_backward_frees_saved_activations_as_it_goes():
    # Each node releases what it saved right after it runs: at an early layer's gradient hook,
    # the later layers' saved activations (16 MiB each here) are already freed.
    x = bt.randn((2048, 2048), device="cuda", requires_grad=True)
    act = 2048 * 2048 * 4
    hs, at_hook = [], {}

    def record(i):
        def hook(g):
            at_hook[i] = bt.cuda.memory_allocated()

        return hook

    h = x
    for i in range(6):
        h = bt.exp(h * 0.01)  # exp keeps its output for backward
        h.register_hook(record(i))
        hs.append(h)
    loss = h.sum()
    del hs, h
    loss.backward()
    bt.cuda.synchronize()
    # layers 5 to 2 ran (and let go of their outputs) between the hooks of layers 5 and 1; the
    # gradients in flight differ by at most one tensor (when the backward kept them all, the
    # memory at hook 1 was at least that at hook 5)
    assert at_hook[1] <= at_hook[5] - 2.5 * act, at_hook
