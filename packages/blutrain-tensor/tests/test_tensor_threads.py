"""The CPU thread budget and its pool (src/cpu/parallel.cpp): the budget's default, results that
do not depend on the thread count, OpenBLAS's jobs on the same pool, an idle pool that sleeps,
and a forked child."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import blutrain.tensor as bt

try:
    import blutrain.linalg as la
except ImportError:  # pragma: no cover
    la = None


@pytest.fixture
def restore_threads():
    n = bt.get_num_threads()
    yield
    bt.set_num_threads(n)


def _run(code: str, env: dict | None = None) -> str:
    """Runs code in a fresh interpreter (its own thread budget); returns its stdout."""
    e = dict(os.environ)
    e.pop("OMP_NUM_THREADS", None)
    e.update(env or {})
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=e
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


# ---- the budget -----------------------------------------------------------------------------
def test_available_cpus_is_the_affinity_mask_at_most():
    assert 1 <= bt.available_cpus() <= len(os.sched_getaffinity(0))


def test_default_budget_follows_affinity_and_omp_num_threads():
    code = """
        import os
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        import blutrain.tensor as bt
        print(bt.available_cpus(), bt.get_num_threads())
    """
    assert _run(code).split() == ["1", "1"]
    assert (
        _run(
            "import blutrain.tensor as bt; print(bt.get_num_threads())", {"OMP_NUM_THREADS": "3"}
        ).strip()
        == "3"
    )
    # a nested OpenMP list gives its first level; junk is ignored (the affinity count)
    out = _run(
        "import blutrain.tensor as bt; print(bt.get_num_threads(), bt.available_cpus())",
        {"OMP_NUM_THREADS": "5,2"},
    ).split()
    assert out[0] == "5"
    out = _run(
        "import blutrain.tensor as bt; print(bt.get_num_threads(), bt.available_cpus())",
        {"OMP_NUM_THREADS": "many"},
    ).split()
    assert out[0] == out[1]


def test_set_num_threads_checks_its_argument(restore_threads):
    for bad in (0, -1, 5000):
        with pytest.raises(ValueError, match=r"^\[set_num_threads\] n must be between 1 and 4096"):
            bt.set_num_threads(bad)
    bt.set_num_threads(3)
    assert bt.get_num_threads() == 3
    if la is not None:
        assert la.get_option("num_threads") == 3  # OpenBLAS splits its GEMMs as many ways


def _cgroup_tree(tmp_path, v2: bool, quotas: dict[str, str]) -> tuple[str, str]:
    root = tmp_path / "cg"
    for rel, text in quotas.items():
        d = root / rel
        d.mkdir(parents=True, exist_ok=True)
        if v2:
            (d / "cpu.max").write_text(text + "\n")
        else:
            q, p = text.split()
            (d / "cpu.cfs_quota_us").write_text(q + "\n")
            (d / "cpu.cfs_period_us").write_text(p + "\n")
    return str(root)


def test_cgroup_v2_quota_is_the_tightest_on_the_path_rounded_up(tmp_path):
    self_cg = tmp_path / "self"
    self_cg.write_text("0::/a/b\n")
    root = _cgroup_tree(
        tmp_path, True, {"": "max 100000", "a": "250000 100000", "a/b": "max 100000"}
    )
    assert bt._C._cgroup_cpus(str(self_cg), root) == 3  # 2.5 CPUs from the parent
    root = _cgroup_tree(tmp_path, True, {"a": "50000 100000", "a/b": "400000 100000"})
    assert bt._C._cgroup_cpus(str(self_cg), root) == 1  # half a CPU still runs one thread
    for d in ("a", "a/b"):
        (tmp_path / "cg" / d / "cpu.max").write_text("max 100000\n")
    assert bt._C._cgroup_cpus(str(self_cg), root) == 0  # no limit
    assert bt._C._cgroup_cpus(str(tmp_path / "missing"), root) == 0


def test_cgroup_v1_quota(tmp_path):
    self_cg = tmp_path / "self"
    self_cg.write_text("12:memory:/x\n4:cpu,cpuacct:/job\n")
    root = tmp_path / "cg"
    for mount in ("cpu,cpuacct",):
        d = root / mount / "job"
        d.mkdir(parents=True)
        (d / "cpu.cfs_quota_us").write_text("300000\n")
        (d / "cpu.cfs_period_us").write_text("100000\n")
    assert bt._C._cgroup_cpus(str(self_cg), str(root)) == 3
    (root / "cpu,cpuacct" / "job" / "cpu.cfs_quota_us").write_text("-1\n")
    assert bt._C._cgroup_cpus(str(self_cg), str(root)) == 0


# ---- results do not depend on the thread count --------------------------------------------------
def _workload(seed: int) -> list[np.ndarray]:
    """Ops whose CPU kernels run on the pool (rows, chunks, reductions, AdamW), no GEMM."""
    rng = np.random.default_rng(seed)
    x = bt.tensor(rng.standard_normal((300, 700)).astype(np.float32), requires_grad=True)
    g = bt.tensor(rng.standard_normal(700).astype(np.float32), requires_grad=True)
    c = bt.tensor(rng.standard_normal(700).astype(np.float32), requires_grad=True)
    t = bt.tensor(rng.integers(0, 700, 300))
    h = bt.layer_norm(x, (700,), g, None)
    # layer-norm backward's column sums (dweight, dbias, and dsum for the residual bias) run
    # over blocks of rows: Note [column blocks]
    s, h2 = bt.add_layer_norm(h, x, g, c, residual_bias=c)
    y = bt.gelu(h + h2, "tanh")
    p = bt.softmax(y, -1)
    loss = bt.cross_entropy(y, t) + (p * p).sum() + y.T.exp().mean(0).sum() + (s * s).mean()
    loss.backward()
    out = [loss.detach().numpy().copy(), x.grad.numpy().copy(), g.grad.numpy().copy()]
    out.append(c.grad.numpy().copy())
    params, grads = [x.detach(), g.detach()], [x.grad, g.grad]
    out.append(bt._tensor._grad_norm(grads).numpy().copy())
    moments = [[bt.zeros_like(p) for p in params] for _ in range(2)]
    for step in (1, 2):
        bt._tensor._adamw_(params, grads, *moments, 1e-2, 0.9, 0.95, 1e-8, 0.1, step)
    out += [p.numpy().copy() for p in params]
    return out


def test_op_kernels_give_the_same_bits_at_any_thread_count(restore_threads, rng):
    # Each kernel computes an output element (a row, a chunk, a column) the same way whichever
    # thread runs it. (OpenBLAS's GEMMs are the exception: how it splits K can depend on its
    # thread count; see the next test.)
    seed = int(rng.integers(1 << 30))
    ref = None
    for n in (1, 2, 3, 5):
        bt.set_num_threads(n)
        out = _workload(seed)
        ref = ref or out
        for i, (a, b) in enumerate(zip(ref, out)):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), (n, i)


GEMM_PROBE = """
    import hashlib, numpy as np
    import blutrain.tensor as bt
    bt.set_num_threads({n})
    rng = np.random.default_rng({seed})
    h = hashlib.sha256()
    for m, k, n in ((300, 700, 500), (1024, 512, 128), (128, 1024, 512), (64, 50304, 128)):
        a = bt.tensor(rng.standard_normal((m, k)).astype(np.float32), requires_grad=True)
        b = bt.tensor(rng.standard_normal((k, n)).astype(np.float32), requires_grad=True)
        c = a @ b
        c.backward(bt.tensor(rng.standard_normal((m, n)).astype(np.float32)))
        for t in (c.detach(), a.grad, b.grad):
            h.update(t.numpy().tobytes())
    print(h.hexdigest())
"""


@pytest.mark.skipif(la is None, reason="blutrain-linalg is not installed")
@pytest.mark.parametrize("n", [2, 3])
def test_gemm_blocks_give_the_one_thread_bits_through_autograd(n, rng):
    # BLUTRAIN_BLAS_THREADS=blocks (Note [GEMM blocks] in blutrain-linalg): the products and both
    # gradients of every probe shape are those of one thread (and of one thread in jobs mode).
    seed = int(rng.integers(1 << 30))
    blocks = {"BLUTRAIN_BLAS_THREADS": "blocks"}
    one = _run(GEMM_PROBE.format(n=1, seed=seed), {"BLUTRAIN_BLAS_THREADS": "jobs"})
    assert _run(GEMM_PROBE.format(n=1, seed=seed), blocks) == one
    assert _run(GEMM_PROBE.format(n=n, seed=seed), blocks) == one


@pytest.mark.skipif(la is None, reason="blutrain-linalg is not installed")
@pytest.mark.parametrize("n", [1, 2, 3])
def test_gemm_jobs_on_the_pool_give_openblas_own_bits(n, rng):
    # BLUTRAIN_BLAS_THREADS=jobs: OpenBLAS splits a GEMM into jobs the same way whichever threads
    # run them, so on our pool the results are those of its own threads at the same count.
    seed = int(rng.integers(1 << 30))
    ours = _run(GEMM_PROBE.format(n=n, seed=seed), {"BLUTRAIN_BLAS_THREADS": "jobs"})
    own = _run(GEMM_PROBE.format(n=n, seed=seed), {"BLUTRAIN_BLAS_THREADS": "openblas"})
    assert ours == own


def test_a_bad_blas_threads_setting_is_refused_at_import():
    e = dict(os.environ, BLUTRAIN_BLAS_THREADS="openmp")
    r = subprocess.run(
        [sys.executable, "-c", "import blutrain.tensor"], capture_output=True, text=True, env=e
    )
    assert r.returncode != 0
    assert (
        "[blutrain.tensor] BLUTRAIN_BLAS_THREADS is 'openmp'; expected blocks, jobs (the "
        "default) or openblas" in r.stderr
    )


# ---- GEMM blocks: one thread's bits at every count (Note [GEMM blocks], blutrain-linalg) --------
@pytest.fixture
def blocks(restore_threads):
    """GEMMs in blocks mode for the test (BLUTRAIN_BLAS_THREADS=blocks), then the mode before."""
    if la is None:
        pytest.skip("blutrain-linalg is not installed")
    before = bt._C._blas_threads()
    bt._C._set_blas_threads("blocks")
    yield
    bt._C._set_blas_threads(before)


def test_blas_threads_mode_switches_and_checks_its_value(restore_threads):
    before = bt._C._blas_threads()
    assert before in ("jobs", "blocks", "openblas")
    with pytest.raises(ValueError, match=r"BLUTRAIN_BLAS_THREADS is 'x'; expected blocks"):
        bt._C._set_blas_threads("x")
    assert bt._C._blas_threads() == before
    a = np.random.default_rng(0).standard_normal((1000, 300)).astype(np.float32)
    try:
        for mode, cut in (("jobs", 0), ("blocks", 1), ("openblas", 0)):
            bt._C._set_blas_threads(mode)
            bt.set_num_threads(2)
            n0 = la.get_option("cpu_block_gemms") if la is not None else 0
            y = bt.tensor(a) @ bt.tensor(a.T.copy())  # 27M multiply-adds: cut in blocks mode
            assert y.shape == (1000, 1000)
            if la is not None:
                assert la.get_option("cpu_block_gemms") - n0 == cut, mode
    finally:
        bt._C._set_blas_threads(before)


def _openblas():
    """OpenBLAS's own cblas_?gemm (the library blutrain-linalg loaded: the same handle)."""
    import ctypes

    import scipy_openblas32 as so

    lib = ctypes.CDLL(os.path.join(so.get_lib_dir(), f"lib{so.get_library()}.so"))

    def gemm(a, b, transa, transb):
        m, k = (a.shape[1], a.shape[0]) if transa else a.shape
        n = b.shape[0] if transb else b.shape[1]
        c = np.zeros((m, n), a.dtype)
        f64 = a.dtype == np.float64
        f = lib.scipy_cblas_dgemm if f64 else lib.scipy_cblas_sgemm
        s, p = ctypes.c_double if f64 else ctypes.c_float, ctypes.c_void_p
        row_major, no_trans, trans = 101, 111, 112
        f(row_major, trans if transa else no_trans, trans if transb else no_trans, m, n, k,
          s(1.0), p(a.ctypes.data), a.shape[1], p(b.ctypes.data), b.shape[1], s(0.0),
          p(c.ctypes.data), n)  # fmt: skip
        return c

    return gemm


# (m, n, k): row tails (m not a multiple of the 96-row block edge), column tails (n not a
# multiple of any micro-kernel unroll), odd and long k, a tall-skinny, a short-wide, GPT-2's head.
BLOCK_SHAPES = [
    (1000, 999, 777),
    (2048, 513, 1024),
    (600, 500, 700),
    (400, 1025, 2049),
    (4099, 33, 300),
    (1024, 2047, 128),
    (1000, 7, 4100),
    (1024, 50304 // 8, 128),
]


def _bits_equal(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and np.array_equal(a.view(np.uint8), b.view(np.uint8))
    )


@pytest.mark.skipif(la is None, reason="blutrain-linalg is not installed")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gemm_blocks_give_openblas_one_thread_bits(blocks, rng, dtype):
    # Each product at 1, 2 and 3 threads is bitwise OpenBLAS's own single-threaded call (the
    # call blutrain makes at one thread in every mode), for every transpose.
    ref_gemm = _openblas()
    for m, n, k in BLOCK_SHAPES:
        for ta in (False, True):
            for tb in (False, True):
                a = rng.standard_normal((k, m) if ta else (m, k)).astype(dtype)
                b = rng.standard_normal((n, k) if tb else (k, n)).astype(dtype)
                bt.set_num_threads(1)  # OpenBLAS at one thread for the reference
                ref = ref_gemm(a, b, ta, tb)
                for t in (1, 2, 3):
                    bt.set_num_threads(t)
                    blocked = la.get_option("cpu_block_gemms")
                    got = la.matmul(a, b, transa=ta, transb=tb)
                    assert _bits_equal(got, ref), (m, n, k, ta, tb, t)
                    # cut into blocks at 2 and 3 threads (else this test proves nothing)
                    assert la.get_option("cpu_block_gemms") - blocked == (t > 1), (m, n, k, t)


@pytest.mark.skipif(la is None, reason="blutrain-linalg is not installed")
def test_gemm_blocks_with_epilogues_batches_and_16_bit_types(blocks, rng):
    # Everything around the product (operand conversion, C and beta, the epilogues, bias
    # gradients, batches run item by item in parallel) gives the one-thread bits too.
    torch = pytest.importorskip("torch")
    m, n, k = 1100, 515, 300

    def rnd(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    a, b, c, bias, pre = rnd(m, k), rnd(n, k), rnd(m, n), rnd(n), rnd(m, n)
    g, x = rnd(m, n), rnd(m, 300)
    small_a, small_b = rnd(6, 97, 64), rnd(6, 64, 131)  # items too small to cut: whole items
    big_a, big_b = rnd(2, 700, 300), rnd(2, 333, 300)  # items cut into blocks, one after another
    cases = {
        "bias_gelu_aux": lambda: la.matmul(a, b, transb=True, bias=bias, epilogue="bias_gelu_aux"),
        "dgelu_bgrad": lambda: la.matmul(a, b, transb=True, aux=pre, epilogue="dgelu_bgrad"),
        "bgrad_a": lambda: la.matmul(g, x, transa=True, epilogue="bgrad_a"),
        "alpha_beta_c": lambda: la.matmul(a, b, transb=True, c=c, alpha=2.0, beta=0.5),
        "tf32": lambda: la.matmul(a, b, transb=True, mode="tf32"),
        "batched_small": lambda: la.matmul(small_a, small_b),
        "batched_large": lambda: la.matmul(big_a, big_b, transb=True),
    }
    for dt in ("bfloat16", "float16"):
        ta = torch.from_numpy(a).to(getattr(torch, dt))
        tb = torch.from_numpy(b).to(getattr(torch, dt))
        cases[dt] = lambda ta=ta, tb=tb: la.matmul(ta, tb, transb=True).float().numpy()
    for name, f in cases.items():
        bt.set_num_threads(1)
        one = f()
        for t in (2, 3):
            bt.set_num_threads(t)
            got = f()
            if isinstance(one, tuple):
                assert all(_bits_equal(x, y) for x, y in zip(one, got)), (name, t)
            else:
                assert _bits_equal(one, got), (name, t)


@pytest.mark.skipif(la is None, reason="blutrain-linalg is not installed")
def test_gemm_blocks_finish_on_their_caller_while_the_workers_cannot_run(blocks, rng):
    # A loaded machine: the pool's workers cannot run. A GEMM's blocks must all run on its
    # caller (never wait for a worker), with the bits of free workers.
    bt.set_num_threads(2)
    a = rng.standard_normal((2000, 300)).astype(np.float32)
    b = rng.standard_normal((300, 700)).astype(np.float32)
    free = la.matmul(a, b)
    blocked0, stats0 = la.get_option("cpu_block_gemms"), bt._C._cpu_pool_stats()
    released = threading.Event()
    bt._C._cpu_pool_hold_workers(True)
    timer = threading.Timer(60.0, lambda: (released.set(), bt._C._cpu_pool_hold_workers(False)))
    timer.start()
    try:
        held = la.matmul(a, b)
    finally:
        bt._C._cpu_pool_hold_workers(False)
        timer.cancel()
    stats1 = bt._C._cpu_pool_stats()
    assert not released.is_set(), "a GEMM waited for a worker that could not run"
    assert la.get_option("cpu_block_gemms") == blocked0 + 1
    regions, by_caller, by_workers, waits = (y - x for x, y in zip(stats0, stats1))
    assert regions == 1 and by_workers == 0 and waits == 0 and by_caller >= 2
    assert _bits_equal(free, held)


@pytest.mark.skipif(la is None, reason="blutrain-linalg is not installed")
def test_gemms_from_several_python_threads(restore_threads, rng):
    # linalg's gemm releases the GIL: while one thread's GEMM holds the pool, another's OpenBLAS
    # jobs get threads of their own (they must run at the same time) and still give the same bits.
    bt.set_num_threads(2)
    a = rng.standard_normal((384, 512)).astype(np.float32)
    b = rng.standard_normal((512, 640)).astype(np.float32)
    ref = (bt.tensor(a) @ bt.tensor(b)).numpy()
    errors: list[str] = []

    def work():
        for _ in range(20):
            d = np.empty((384, 640), np.float32)
            la.matmul(a, b, out=d)
            if not np.array_equal(d, ref):
                errors.append("differs")

    ts = [threading.Thread(target=work) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors


# ---- an idle pool sleeps ----------------------------------------------------------------------
IDLE_PROBE = """
    import os, time, numpy as np
    import blutrain.tensor as bt
    bt.set_num_threads(2)
    time.sleep(0.5)  # OpenBLAS's own worker, started at load, spins about 0.1 s then sleeps
    a = bt.tensor(np.random.rand(512, 512).astype(np.float32))
    for _ in range(3):
        b = (a @ a).exp() + a  # a GEMM, then op loops: both on the pool
    time.sleep(0.05)
    me = os.getpid()
    states = []
    for tid in os.listdir(f"/proc/{me}/task"):
        if int(tid) == me:
            continue
        with open(f"/proc/{me}/task/{tid}/stat") as f:
            states.append(f.read().rsplit(")", 1)[1].split()[0])
    print(" ".join(states))
"""


def test_an_idle_pool_sleeps_after_a_gemm():
    # Every thread but the main one is asleep 50 ms after the last op (R would be a spinning
    # pool stealing a core from whatever runs next). Retried: a busy machine may report a thread
    # as runnable (R) for a moment while it is being woken for something else.
    for _ in range(3):
        states = _run(IDLE_PROBE).split()
        if states and all(s in "SD" for s in states):
            return
    pytest.fail(f"threads still running 50 ms after the last op: {states}")


def test_the_idle_probe_sees_openblas_own_spinning_pool():
    # The probe above can fail: with OpenBLAS's own pool, its worker spins ~0.1 s after a GEMM.
    if la is None:
        pytest.skip("blutrain-linalg is not installed")
    seen = []
    for _ in range(3):
        states = _run(IDLE_PROBE, {"BLUTRAIN_BLAS_THREADS": "openblas"}).split()
        seen.append(states)
        if "R" in states:
            return
    pytest.skip(f"OpenBLAS's worker was not caught spinning here: {seen}")


# ---- fork ---------------------------------------------------------------------------------------
def test_a_forked_child_rebuilds_the_pool(restore_threads):
    bt.set_num_threads(2)
    x = bt.tensor(np.arange(1 << 17, dtype=np.float32))
    ref = float((x * 2).sum().item())  # the pool's workers exist now
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the parent's workers are gone; a parallel op must still finish
        try:
            ok = float((x * 2).sum().item()) == ref
            ok = (
                ok
                and float(
                    (bt.tensor(np.ones((256, 256), np.float32)) @ x[:256].reshape(256, 1))
                    .sum()
                    .item()
                )
                == float(x[:256].sum().item()) * 256
            )
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    deadline = time.time() + 60
    got = b""
    while time.time() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        pytest.fail("the forked child hung in a parallel op")
    got = os.read(r, 1)
    os.close(r)
    assert got == b"1"


# ---- a worker the scheduler has not run delays nothing (Note [claiming, not assigning]) --------
def test_a_region_finishes_on_its_caller_while_the_workers_cannot_run(restore_threads, rng):
    # The workers are held before they can claim a chunk, as a descheduled worker on a loaded
    # machine: every region must still finish, its caller running every chunk, and give the bits
    # of the same ops with the workers free and at one thread. (Before, the caller waited at the
    # join for every worker to check in: this would hang until the release below.)
    seed = int(rng.integers(1 << 30))
    bt.set_num_threads(2)
    free = _workload(seed)
    stats0 = bt._C._cpu_pool_stats()
    released = threading.Event()
    bt._C._cpu_pool_hold_workers(True)
    # a safety net, not a timing bound: a pool that waits for its workers fails, never hangs
    timer = threading.Timer(60.0, lambda: (released.set(), bt._C._cpu_pool_hold_workers(False)))
    timer.start()
    try:
        held = _workload(seed)
    finally:
        bt._C._cpu_pool_hold_workers(False)
        timer.cancel()
    stats1 = bt._C._cpu_pool_stats()
    assert not released.is_set(), "a region waited for a worker that could not run"
    regions, by_caller, by_workers, waits = (b - a for a, b in zip(stats0, stats1))
    assert regions > 10  # the workload's kernels did run on the pool
    assert by_workers == 0 and waits == 0 and by_caller >= regions
    bt.set_num_threads(1)
    one = _workload(seed)
    for i, (a, b, c) in enumerate(zip(free, held, one)):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), i
        assert np.array_equal(a.view(np.uint32), c.view(np.uint32)), i
